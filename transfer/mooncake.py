"""Between hosts over Mooncake's Transfer Engine: RDMA where the NICs are, TCP elsewhere.

The Transfer Engine (``pip install mooncake-transfer-engine-non-cuda``; the package without
``-non-cuda`` on CUDA machines) is the library SGLang, vLLM and LMCache move KV with. Each
process runs one engine; a target registers its pool's memory with it, and an initiator's
writes land there one-sided: RDMA WRITEs over an RC queue pair with protocol ``rdma``,
Mooncake's own acknowledged framing over TCP with protocol ``tcp``. In both, a write reports
COMPLETED only once its bytes are applied in the target's memory (RC completion; Mooncake's
TCP status frame, sent after the last chunk is written), and the target refuses a write
outside its registered buffers.

Target side: ``MooncakeRegion`` is a pool in this process's memory, registered with the
engine; its handle's ``address`` is ``<segment>@<base address>``, the segment being the
engine's ``host:rpc_port``. ``key`` is a random token Mooncake does not check: anyone who can
reach the engine's ports can write into registered memory (docs/security.md).

Initiator side: a ``MooncakeWriter``'s owner thread submits each written layer run's byte
ranges as writes as soon as the layer is handed over and polls them from its loop (every
``POLL_S`` while any is in flight). A job succeeds once ``finish`` came and every write it
submitted completed. A failed job submits nothing more; it drains until every write it
submitted reached a terminal status, and is quiet unless one of them failed or timed out
(a write that failed mid-way may leave bytes in a socket buffer that still land).

Protocol ``auto`` is ``rdma`` when this host has an RDMA device (pyverbs lists them; without
pyverbs, ``/sys/class/infiniband``) and ``tcp`` otherwise.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from transfer.base import KVRegion, KVSource, TransferJob, Transport
from transfer.errors import TransferError
from transfer.handle import KVLayout, MemoryRegionHandle
from transfer.writer import Drop, JobWork, OwnerThreadWriter, lowest_run

TRANSPORT_NAME = "mooncake"
PROTOCOLS = ("auto", "tcp", "rdma")
INSTALL_HINT = (
    "pip install mooncake-transfer-engine-non-cuda (mooncake-transfer-engine on CUDA "
    "machines) and apt-get install libibverbs1 ibverbs-providers libnuma1 libcurl4 "
    "(scripts/setup.sh does both)"
)
# While writes are in flight the owner polls them this often: the most a completion waits
# to be noticed.
POLL_S = 0.0005
# transfer_check_status: 1 completed, 0 in flight, -1 failed, -2 timed out.
_COMPLETED, _IN_FLIGHT = 1, 0


def load_engine() -> Any:
    """A new, uninitialised ``mooncake.engine.TransferEngine``; ``TransferError`` naming the
    packages to install when the library or its libibverbs is missing."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransferError(
            f"the mooncake transport needs Mooncake's Transfer Engine ({exc}): {INSTALL_HINT}"
        ) from exc
    return TransferEngine()


def rdma_devices() -> list[str]:
    """This host's RDMA devices: pyverbs' list where pyverbs is installed, else the names
    under ``/sys/class/infiniband`` (what libibverbs itself enumerates)."""
    try:
        import pyverbs.device as verbs_device
    except ImportError:
        try:
            return sorted(os.listdir("/sys/class/infiniband"))
        except OSError:
            return []
    return [dev.name.decode() for dev in verbs_device.get_device_list()]


def resolve_protocol(protocol: str, devices: Sequence[str]) -> str:
    """``auto`` -> ``rdma`` when ``devices`` (this host's RDMA devices) is not empty, else
    ``tcp``; ``rdma`` with no device is a ``TransferError``."""
    if protocol not in PROTOCOLS:
        raise TransferError(f"mooncake protocol must be one of {', '.join(PROTOCOLS)}")
    if protocol == "auto":
        return "rdma" if devices else "tcp"
    if protocol == "rdma" and not devices:
        raise TransferError("mooncake protocol rdma: this host has no RDMA device")
    return protocol


def parse_address(address: str) -> tuple[str, int]:
    """``"<host:port>@<base hex>"`` -> ``(segment, base)``; ``TransferError`` if malformed."""
    segment, sep, base = address.rpartition("@")
    host, colon, port = segment.rpartition(":")
    try:
        value = int(base, 16)
        port_number = int(port)
    except ValueError:
        value = port_number = -1
    if not sep or not colon or not host or value <= 0 or not 0 < port_number < 65536:
        raise TransferError(f"mooncake handle address {address!r} is not <host:port>@<base hex>")
    return segment, value


class MooncakeRegion(KVRegion):
    """A KV pool in this process's memory, registered with the transport's engine."""

    def __init__(self, layout: KVLayout, transport: MooncakeTransport) -> None:
        length = layout.total_bytes
        tensor = torch.zeros(length, dtype=torch.uint8)
        base = tensor.data_ptr()
        if transport.engine.register_memory(base, length) != 0:
            raise TransferError(f"mooncake could not register a {length}-byte KV pool")
        handle = MemoryRegionHandle(
            transport=TRANSPORT_NAME,
            address=f"{transport.segment}@{base:#x}",
            length=length,
            key=secrets.token_hex(16),
            layout=layout,
            region_id=uuid.uuid4().hex,
        )
        super().__init__(handle, tensor)
        self._transport = transport
        self._base = base
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unregister the pool: the engine refuses writes into it from now on."""
        if not self._closed:
            self._closed = True
            engine = self._transport.engine
            if engine is not None:  # else the transport closed, and the engine with it
                engine.unregister_memory(self._base)


class MooncakeWork(JobWork):
    """A job's progress on the mooncake transport (owner thread only)."""

    def __init__(self, job: TransferJob) -> None:
        super().__init__(job)
        self.in_flight: dict[int, int] = {}  # submitted write (batch id) -> its bytes
        self.unsure = False  # a write of it failed or timed out: its bytes' fate is unknown


class MooncakeWriter(OwnerThreadWriter):
    """Writes one source pool's blocks into one remote registered region, on its owner
    thread, through the transport's engine."""

    def __init__(
        self, handle: MemoryRegionHandle, source: KVSource, transport: MooncakeTransport
    ) -> None:
        if source.tensor.device.type != "cpu":
            raise TransferError(f"mooncake sends from host memory, not {source.tensor.device}")
        super().__init__(handle, source)
        self._segment, self._base = parse_address(handle.address)
        self._src_base = source.tensor.data_ptr()
        # Through the transport, never a reference of its own: the engine must go when the
        # transport closes (MooncakeTransport.close).
        self._transport = transport
        # The engine dials the segment at the first write, on the owner thread and with no
        # deadline of its own: check here (the caller's thread) that it answers at all.
        host, _, port = self._segment.rpartition(":")
        try:
            address = (host.strip("[]"), int(port))
            socket.create_connection(address, transport.connect_timeout).close()
        except OSError as exc:
            raise TransferError(f"cannot reach mooncake segment {self._segment}: {exc}") from exc
        self._launch()

    def _new_work(self, job: TransferJob) -> MooncakeWork:
        return MooncakeWork(job)

    def _next_wait(self) -> float | None:
        wait = super()._next_wait()
        if any(w.in_flight for w in self._all_works()):
            return POLL_S if wait is None else min(wait, POLL_S)
        return wait

    def _all_works(self) -> list[MooncakeWork]:
        """Jobs running and jobs draining: every one that may have writes in flight."""
        works = [*self._works.values(), *self._draining]
        return [w for w in works if isinstance(w, MooncakeWork)]

    def _move(self) -> None:
        self._each_pending(self._submit)
        self._poll()

    def _submit(self, work: JobWork) -> None:
        """Submit every pending layer run of ``work``, one write per byte range."""
        assert isinstance(work, MooncakeWork)
        while work.pending:
            start, stop = lowest_run(work.pending)
            self._inject(work)
            for layer in range(start, stop):
                for src, dst, n in work.job.blocks.ranges(layer):
                    batch = self._transport.engine.transfer_submit_write(
                        self._segment, self._src_base + src, self._base + dst, n
                    )
                    if not 0 < batch < 1 << 63:  # 0 or a negative batch id: not submitted
                        raise TransferError(f"mooncake could not submit a write to {self._segment}")
                    work.in_flight[batch] = n
            self._moved(work, start, stop)

    def _poll(self) -> None:
        """Collect the writes that reached a terminal status; end the jobs they complete."""
        for work in self._all_works():
            failed = 0
            for batch, n in list(work.in_flight.items()):
                status = self._transport.engine.transfer_check_status(batch)
                if status == _IN_FLIGHT:
                    continue
                del work.in_flight[batch]
                if status == _COMPLETED:
                    self._landed(work, n)
                else:
                    failed += 1
            if failed:
                work.unsure = True
                error = TransferError(f"{failed} mooncake write(s) to {self._segment} failed")
                self._fail(work, error)
            if work.in_flight:
                continue
            if work.error is not None:
                if work in self._draining:
                    self._resolve(work, quiet=not work.unsure)
            elif work.ended:
                self._succeed(work)

    def _end(self, work: JobWork) -> None:
        assert isinstance(work, MooncakeWork)
        if not work.in_flight:
            self._succeed(work)  # else _poll succeeds it once its last write completed

    def _drop(self, work: JobWork) -> Drop:
        assert isinstance(work, MooncakeWork)
        if work.in_flight:
            return Drop.DRAINING
        return Drop.UNKNOWN if work.unsure else Drop.QUIET

    def _give_up(self, work: JobWork) -> None:
        assert isinstance(work, MooncakeWork)
        work.in_flight.clear()  # the engine keeps those writes; nobody polls them any more


class MooncakeTransport(Transport):
    """``mooncake``: one Transfer Engine for this process, as target and as initiator.

    ``host`` is the name peers reach this engine by (its segment is ``host:rpc_port``; it
    listens on every interface). ``protocol``: ``auto``, ``tcp`` or ``rdma``; ``devices``:
    the RDMA devices the engine may use (empty: all). ``connect_timeout`` bounds the check
    that a destination answers before a writer to it opens.
    """

    name = TRANSPORT_NAME

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        protocol: str = "auto",
        devices: Sequence[str] = (),
        connect_timeout: float = 5.0,
    ) -> None:
        super().__init__()
        self.protocol = resolve_protocol(protocol, list(devices) or rdma_devices())
        self.engine: Any = load_engine()  # None once closed
        rc = self.engine.initialize(host, "P2PHANDSHAKE", self.protocol, ",".join(devices))
        if rc != 0:
            raise TransferError(
                f"mooncake Transfer Engine did not start on {host} over {self.protocol} (rc {rc})"
            )
        self.segment = f"{host}:{self.engine.get_rpc_port()}"
        self.connect_timeout = connect_timeout
        self._sources_lock = threading.Lock()
        self._sources: set[int] = set()  # source pools registered with the engine

    def _register(self, layout: KVLayout) -> KVRegion:
        return MooncakeRegion(layout, self)

    def _open_writer(self, handle: MemoryRegionHandle, source: KVSource) -> MooncakeWriter:
        base, length = source.tensor.data_ptr(), source.tensor.numel()
        with self._sources_lock:
            new = base not in self._sources
            if new:
                self._sources.add(base)
        # Registered once per pool (RDMA reads it through its local key); it stays
        # registered for the transport's life, as the pool does.
        if new and self.engine.register_memory(base, length) != 0:
            with self._sources_lock:
                self._sources.discard(base)
            raise TransferError(f"mooncake could not register the {length}-byte source pool")
        return MooncakeWriter(handle, source, self)

    def close(self) -> None:
        """Close every writer and region, then the engine itself. Its teardown takes most of
        a second and holds the GIL: here, once, rather than wherever the garbage collector
        would happen to drop the last reference."""
        super().close()
        engine, self.engine = self.engine, None
        if engine is None:
            return
        with self._sources_lock, contextlib.suppress(Exception):
            for base in self._sources:
                engine.unregister_memory(base)
            self._sources.clear()
        del engine  # the last reference: the engine stops here

"""The KV data plane's interface: register a pool once, let peers write into it one-sided.

Target side (decode worker)::

    region = transport.register(layout)           # allocate + register the pool's memory
    cache = KVCache(layout.to_spec(), buffer=region.tensor)
    send region.handle (and the destination block ids) in the Prefill call

Initiator side (prefill worker)::

    source = KVSource(cache.as_bytes(), layout)   # the local pool, registered once
    writer = transport.connect(handle, source)    # cached per (region, source)
    job = writer.begin(request_id, src_ids, dst_ids, deadline=time.monotonic() + 5.0)
    job.write_layer(layer, ready)                 # engine thread, as each layer's KV lands
                                                  # (ready: a GPU's layer staged to host)
    result = await asyncio.wrap_future(job.finish())  # bytes are in the target's memory now

Ownership: each writer has one owner thread (``transfer/writer.py``) that alone touches
its mapping or socket and every job's progress. ``begin`` plans the block runs once in the
caller's thread (pure); ``write_layer``, ``finish`` and ``abort`` only post a message to
the owner. A job's outcome is a ``concurrent.futures.Future`` the owner resolves; its
``state`` is the poll view of it: TRANSFERRING, then SUCCESS or FAILED (terminal, with the
reason in ``error``: ``TransferTimeout`` past the deadline, ``TransferError`` for a dead
peer, a broken connection or an abort). The owner resolves a failed job only once it will
read none of the job's source bytes again, so the caller may then release the source blocks.

Contract for the target (the fence): once a job's outcome is in, ``job.quiet`` says whether
any byte of it can still land in its destination blocks. True: none can (a success; a copy
that stopped on this thread; bytes the receiver confirmed it dropped or the transport
confirmed applied), so the blocks may go to another request at once. False: some bytes'
fate is unknown (a connection died with bytes in flight), so the decode worker must not
hand those blocks out before the KV lease of the failure model ends (the writer's deadline
plus a grace period longer than any transport's worst case).

How RDMA maps onto this one to one: ``register`` is ``ibv_reg_mr`` over the pool (the
handle carries the remote address, the rkey as ``key`` and the rdma_cm ``host:port`` a peer
connects its RC queue pair to); ``connect`` registers the source pool (lkey) and creates and
connects the queue pair; the owner thread posts one RDMA WRITE per run for each layer it is
handed, polls the completion queue in its loop, and for ``finish`` posts a signalled
WRITE-with-immediate whose completion confirms the job; ``abort`` stops posting and waits
for the writes already posted to complete. No method here assumes a socket or a mapping.
"""

from __future__ import annotations

import enum
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import ClassVar

import torch

from transfer.block_runs import BlockRuns, block_runs
from transfer.errors import TransferError
from transfer.faults import FaultDice, FaultSpec
from transfer.handle import KVLayout, MemoryRegionHandle

LayerReady = Callable[[float], bool]
"""``ready(deadline)``: wait until a layer's source bytes are in the source pool; False if
``deadline`` (``time.monotonic()`` seconds) passed first."""


class JobState(enum.Enum):
    """Where a job is, as a poller sees it (SGLang's sender states, minus the bootstrap)."""

    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"  # terminal; ``TransferJob.error`` says why


@dataclass(frozen=True)
class TransferResult:
    """One finished job: ``bytes`` confirmed in the target's memory over ``layers`` layers.

    ``seconds`` runs from the job's first layer to its confirmation (it overlaps compute);
    ``wait_seconds`` from ``finish()`` to the confirmation: the transfer's cost to time to
    first token. ``present_at_last_layer``: the bytes the writer had delivered when the last
    layer was handed to it, i.e. when the prefill computed its last layer (shm: copied;
    mooncake: applied and acknowledged; tcp: handed to the socket): the layer-wise overlap.
    """

    bytes: int
    seconds: float
    layers: int
    wait_seconds: float
    present_at_last_layer: int = 0


@dataclass(frozen=True)
class TransferStats:
    """Counters a service exports: ``bytes`` moved (also of jobs that later failed), summed
    ``seconds`` and count of successful ``jobs``, and ``failures`` (aborts excluded)."""

    bytes: int = 0
    seconds: float = 0.0
    jobs: int = 0
    failures: int = 0


class StatsCounter:
    """Thread-safe accumulator behind a ``TransferStats`` snapshot (receivers' threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = TransferStats()

    def add(
        self, *, bytes: int = 0, seconds: float = 0.0, jobs: int = 0, failures: int = 0
    ) -> None:
        with self._lock:
            s = self._stats
            self._stats = TransferStats(
                s.bytes + bytes, s.seconds + seconds, s.jobs + jobs, s.failures + failures
            )

    def snapshot(self) -> TransferStats:
        return self._stats


@dataclass(frozen=True, eq=False)
class KVSource:
    """The local KV pool a writer copies from: ``KVCache.as_bytes()`` and its layout.

    Made once per pool; writers keep it (for RDMA: the registered local memory), so its
    bytes must stay allocated for as long as the transport lives.
    """

    tensor: torch.Tensor
    layout: KVLayout

    def __post_init__(self) -> None:
        t = self.tensor
        if (
            not isinstance(t, torch.Tensor)
            or t.dtype != torch.uint8
            or t.dim() != 1
            or not t.is_contiguous()
        ):
            raise TransferError("a KV source must be a flat contiguous uint8 tensor")
        if t.device.type not in ("cpu", "cuda"):
            raise TransferError(f"a KV source must be in CPU or CUDA memory, got {t.device}")
        if t.numel() < self.layout.total_bytes:
            raise TransferError(
                f"a KV source of {t.numel()} bytes cannot hold its {self.layout.total_bytes}-byte "
                "layout"
            )


class KVRegion(ABC):
    """Registered memory a KV pool lives in; owned by the target process.

    ``tensor`` is a flat uint8 tensor of ``handle.length`` bytes (build the pool on it with
    ``KVCache(spec, buffer=region.tensor)``); ``handle`` is what peers need to write into it.
    ``close()`` unregisters and releases the memory's name; it is idempotent and the tensor
    stays valid (unshared) while references to it live.
    """

    def __init__(self, handle: MemoryRegionHandle, tensor: torch.Tensor) -> None:
        self.handle = handle
        self.tensor = tensor
        self.counter = StatsCounter()

    @property
    def layout(self) -> KVLayout:
        return self.handle.layout

    def stats(self) -> TransferStats:
        """What this side saw arrive (one-sided transports see nothing: zeros)."""
        return self.counter.snapshot()

    @property
    @abstractmethod
    def closed(self) -> bool: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> KVRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TransferJob:
    """One request's KV on its way into one region; any thread may hold and use it.

    Immutable but for its outcome: ``begin`` made it and planned it, and every call here only
    posts a message to the writer's owner thread, which alone moves its bytes.
    """

    def __init__(
        self, writer: RegionWriter, request_id: str, blocks: BlockRuns, deadline: float
    ) -> None:
        self.request_id = request_id
        self.blocks = blocks
        self.deadline = deadline
        self.outcome: Future[TransferResult] = Future()
        self.outcome.set_running_or_notify_cancel()  # only the owner ends it, never a cancel
        self._writer = writer
        self._quiet = True  # set by the owner before it resolves the outcome

    @property
    def quiet(self) -> bool:
        """Once the outcome is in: no byte of this job can land in the destination any more
        (always True after a success). False after a failure whose bytes in flight may
        still land: the destination's blocks wait out the KV lease. Read it only after the
        outcome resolved."""
        return self._quiet

    @property
    def state(self) -> JobState:
        if not self.outcome.done():
            return JobState.TRANSFERRING
        return JobState.FAILED if self.outcome.exception() else JobState.SUCCESS

    @property
    def error(self) -> TransferError | None:
        """Why the job failed; None while it runs or after it succeeded."""
        if not self.outcome.done():
            return None
        error = self.outcome.exception()
        assert error is None or isinstance(error, TransferError)
        return error

    def write_layer(self, layer: int, ready: LayerReady | None = None) -> None:
        """Queue the move of ``layer``'s KV, which the source pool now holds (each layer at
        most once). Only posts: never blocks, never raises. A layer outside the layout, or
        written twice or after ``finish``, fails the job; a job that failed ignores it.

        ``ready``: the source bytes are still on their way into the source pool (a GPU
        engine's layer staged to host memory, engine/kv_staging.py); the writer calls
        ``ready(job deadline)`` before it reads them, and a False fails the job."""
        self._writer.post(("layer", self, (layer, ready, time.monotonic())))

    def finish(self) -> Future[TransferResult]:
        """No more layers: the outcome, resolved once every written layer is confirmed in
        the target's memory (or with the failure). Its bytes in the source pool must not
        change until then. Idempotent."""
        self._writer.post(("finish", self, time.monotonic()))
        return self.outcome

    def abort(self, reason: str = "aborted") -> Future[TransferResult]:
        """Fail the job now (layers not yet moved are dropped); the outcome resolves once the
        writer stopped reading its source bytes. Idempotent, never blocks."""
        self._writer.post(("abort", self, reason))
        return self.outcome

    def __repr__(self) -> str:
        return f"TransferJob({self.request_id!r}, {self.state.value})"


class RegionWriter(ABC):
    """An initiator's open path from one source pool into one remote region."""

    def __init__(self, handle: MemoryRegionHandle, source: KVSource) -> None:
        self.handle = handle
        self.source = source
        self.dice: FaultDice | None = None  # a fault spec's decisions (transfer/faults.py)

    def begin(
        self,
        request_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        *,
        deadline: float,
    ) -> TransferJob:
        """Start moving ``src_block_ids[i]`` of the source into ``dst_block_ids[i]`` of the
        region, layer by layer; ``deadline`` is absolute ``time.monotonic()`` seconds.

        Raises ``TransferError`` for bad ids, incompatible layouts or a closed writer. A
        target found gone, or a request id with a job in flight on this writer, fails the
        job (its outcome), not the call.
        """
        if not isinstance(request_id, str) or not request_id:
            raise TransferError(f"request_id must be a non-empty string, got {request_id!r}")
        if (
            not isinstance(deadline, int | float)
            or isinstance(deadline, bool)
            or deadline != deadline
        ):
            raise TransferError(f"deadline must be time.monotonic() seconds, got {deadline!r}")
        if self.closed:
            raise TransferError(f"writer to region {self.handle.region_id} is closed")
        blocks = block_runs(self.source.layout, self.handle.layout, src_block_ids, dst_block_ids)
        job = TransferJob(self, request_id, blocks, float(deadline))
        self.post(("begin", job, None))
        return job

    @abstractmethod
    def post(self, message: tuple[str, TransferJob, object]) -> None:
        """Hand ``(kind, job, argument)`` to the owner thread (``TransferJob`` and ``begin``
        call this); a ``begin`` posted to a closed writer fails its job."""

    @abstractmethod
    def stats(self) -> TransferStats: ...

    @property
    @abstractmethod
    def closed(self) -> bool: ...

    @abstractmethod
    def close(self) -> None:
        """Fail every job in flight with ``TransferError`` and release the path. Idempotent."""


class Transport(ABC):
    """One way of moving bytes; creates regions (target side) and writers (initiator side).

    Writers are cached per region and source: ``connect`` with the same handle and source
    returns the same open writer. ``close`` closes every writer and region this transport made.
    ``source_on_device``: its writers read a GPU engine's own pool (``cuda_ipc``), not the
    host pool that engine stages its layers into (every other transport).
    """

    name: ClassVar[str]
    source_on_device: ClassVar[bool] = False

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the two lists below; never held across I/O
        self._writers: dict[tuple[str, KVSource], RegionWriter] = {}
        self._regions: list[KVRegion] = []
        self._dice: FaultDice | None = None

    @property
    def healthy(self) -> bool:
        """Whether peers can still write into this transport's regions (a transport whose
        receiving side can die says so; the worker then reports NOT_SERVING)."""
        return True

    def inject_faults(self, spec: FaultSpec) -> None:
        """Have writers opened from now on fail, slow down or stall as ``spec`` says (tests,
        chaos runs); an inactive spec injects nothing."""
        self._dice = FaultDice(spec) if spec.transfer_active else None

    @property
    def faults_injected(self) -> int:
        return 0 if self._dice is None else self._dice.injected

    @abstractmethod
    def _register(self, layout: KVLayout) -> KVRegion: ...

    @abstractmethod
    def _open_writer(self, handle: MemoryRegionHandle, source: KVSource) -> RegionWriter: ...

    def register(self, layout: KVLayout) -> KVRegion:
        """Allocate and register memory for a pool of ``layout``; raises ``TransferError``."""
        region = self._register(layout)
        with self._lock:
            self._regions = [r for r in self._regions if not r.closed]
            self._regions.append(region)
        return region

    def connect(self, handle: MemoryRegionHandle, source: KVSource) -> RegionWriter:
        """An open writer from ``source`` into ``handle``'s region; raises ``TransferError``
        if the region is unreachable or its layout cannot take the source's blocks."""
        if handle.transport != self.name:
            raise TransferError(
                f"handle is for transport {handle.transport!r}, this is {self.name!r}"
            )
        source.layout.check_compatible(handle.layout)
        cached = self.open_writer(handle, source)
        if cached is not None:
            return cached
        key = (handle.region_id, source)
        with self._lock:  # forget writers closed since (e.g. their target died)
            self._writers = {k: w for k, w in self._writers.items() if not w.closed}
        writer = self._open_writer(handle, source)  # may block (a TCP connect): not locked
        writer.dice = self._dice  # before anyone has the writer: its owner reads it later
        with self._lock:
            current = self._writers.get(key)
            if current is not None and not current.closed and current.handle == handle:
                loser, writer = writer, current  # a racing opener won
            else:
                loser = current
                self._writers[key] = writer
        if loser is not None:
            loser.close()
        return writer

    def open_writer(self, handle: MemoryRegionHandle, source: KVSource) -> RegionWriter | None:
        """The writer ``connect`` made for ``handle`` and ``source`` if it is still open,
        else None; never blocks (``connect`` may: it can dial the region)."""
        with self._lock:
            cached = self._writers.get((handle.region_id, source))
        if cached is not None and not cached.closed and cached.handle == handle:
            return cached
        return None

    def close(self) -> None:
        with self._lock:
            writers = list(self._writers.values())
            regions = list(self._regions)
            self._writers.clear()
            self._regions.clear()
        for writer in writers:
            writer.close()
        for region in regions:
            region.close()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

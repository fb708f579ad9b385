"""``cuda_ipc``: a decode worker's KV pool in GPU memory, written by a prefill worker's GPU on
the same host through a CUDA IPC handle of that memory. No host memory on the way.

Target side: ``register`` allocates the pool on the transport's CUDA device and exports it
(``torch.UntypedStorage._share_cuda_``, torch's own IPC for tensors shared between
processes); the handle's ``address`` is ``pid@device`` of the owner and its ``key`` the
export (an opaque capability, never logged: whoever holds it can write the pool). The
region's tensor *is* the engine's KV pool.

Initiator side: the writer opens the export once (``_new_shared_cuda``) and, on its owner
thread, copies each written layer's block runs from its source pool (the prefill engine's
device pool) into the region on a stream of its own, then waits for that stream: a copy
between two allocations of one GPU, or peer to peer between two GPUs of the host. The
layer's ``ready`` (the prefill engine's event recorded after the layer's KV store) is
waited for before the copy, as for any transport.

Scope: both workers see the device under the same index (the owner's index travels in the
address), on one host (the scheduler treats ``cuda_ipc`` as host-local, like ``shm``). An
owner that died is noticed by its pid (``os.kill(pid, 0)``), before each job.
"""

from __future__ import annotations

import base64
import json
import os
import uuid
from typing import Any

import torch

from transfer.base import KVRegion, KVSource, Transport
from transfer.errors import TransferError
from transfer.handle import KVLayout, MemoryRegionHandle
from transfer.writer import JobWork, OwnerThreadWriter

_BYTES_FIELDS = (1, 4, 6)  # handle, ref-counter handle, event handle: bytes in the export


def encode_export(export: tuple[Any, ...]) -> str:
    """``_share_cuda_()``'s tuple as the handle's key (JSON, bytes as base64)."""
    fields = [{"b64": base64.b64encode(v).decode()} if isinstance(v, bytes) else v for v in export]
    return base64.b64encode(json.dumps(fields).encode()).decode()


def decode_export(key: str) -> tuple[Any, ...]:
    """The inverse of ``encode_export``; ``TransferError`` for anything else."""
    try:
        fields = json.loads(base64.b64decode(key.encode(), validate=True))
    except ValueError as exc:
        raise TransferError(f"cuda_ipc handle key is not an export: {exc}") from exc
    if not isinstance(fields, list) or len(fields) != 8:
        raise TransferError("cuda_ipc handle key is not an export of 8 fields")
    out: list[Any] = []
    for i, v in enumerate(fields):
        if i in _BYTES_FIELDS and v is not None:  # the event handle may be absent
            if not isinstance(v, dict) or not isinstance(v.get("b64"), str):
                raise TransferError(f"cuda_ipc export field {i} must be bytes")
            out.append(base64.b64decode(v["b64"]))
        elif isinstance(v, dict):
            raise TransferError(f"cuda_ipc export field {i} must not be bytes")
        else:
            out.append(v)
    return tuple(out)


def parse_address(address: str) -> tuple[int, int]:
    """``pid@device`` -> (pid, device index)."""
    pid, sep, device = address.partition("@")
    if not sep or not pid.isdigit() or not device.isdigit():
        raise TransferError(f"cuda_ipc address must be pid@device, got {address!r}")
    return int(pid), int(device)


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise TransferError("the cuda_ipc transport needs CUDA; torch sees no GPU here")


class CudaIpcRegion(KVRegion):
    """A KV pool in this process's GPU memory, exported for writers in other processes."""

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        tensor = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device)
        export = tensor.untyped_storage()._share_cuda_()
        handle = MemoryRegionHandle(
            transport=CudaIpcTransport.name,
            address=f"{os.getpid()}@{tensor.device.index}",
            length=layout.total_bytes,
            key=encode_export(export),
            layout=layout,
            region_id=uuid.uuid4().hex,
        )
        super().__init__(handle, tensor)
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Writers that opened the export keep the memory mapped until they close; this
        side only stops handing the region out."""
        self._closed = True


class CudaIpcWriter(OwnerThreadWriter):
    """Copies a job's layers GPU to GPU into another process's exported pool."""

    def __init__(self, handle: MemoryRegionHandle, source: KVSource) -> None:
        super().__init__(handle, source)
        self._pid, index = parse_address(handle.address)
        if source.tensor.device.type != "cuda":
            raise TransferError(
                f"cuda_ipc writes from a GPU pool; this source is on {source.tensor.device}"
            )
        if not _owner_alive(self._pid):
            raise TransferError(f"owner {self._pid} of cuda_ipc region {handle.region_id} is gone")
        export = decode_export(handle.key)
        if export[0] != index or export[2] != handle.length:
            raise TransferError("cuda_ipc handle: its address and its export disagree")
        try:
            storage = torch.UntypedStorage._new_shared_cuda(*export)
        except RuntimeError as exc:  # another host, another device, a stale export
            raise TransferError(f"cannot open cuda_ipc region {handle.region_id}: {exc}") from exc
        device = torch.device("cuda", index)
        dst = torch.empty(0, dtype=torch.uint8, device=device)
        dst.set_(storage, 0, (handle.length,), (1,))  # type: ignore[call-overload]
        self._dst = dst  # holds the mapping open
        layout = handle.layout
        self._dst_rows = dst[: layout.total_bytes].view(layout.num_layers, 2, -1)
        src = source.tensor[: source.layout.total_bytes]
        self._src_rows = src.view(source.layout.num_layers, 2, -1)
        self._stream = torch.cuda.Stream(source.tensor.device)
        self._launch()

    def _start(self, work: JobWork) -> None:
        if not _owner_alive(self._pid):
            self._retire()
            raise TransferError(f"owner {self._pid} of cuda_ipc region is gone")

    def _move(self) -> None:
        self._copy_pending(self._copy)

    def _copy(self, work: JobWork, start: int, stop: int) -> None:
        """Layers ``[start, stop)`` of ``work``, every block run, on this writer's stream;
        done when the stream is (the bytes are then in the target's memory)."""
        with torch.cuda.stream(self._stream):
            for s, d, n in work.job.blocks.runs:
                self._dst_rows[start:stop, :, d : d + n].copy_(
                    self._src_rows[start:stop, :, s : s + n], non_blocking=True
                )
        self._stream.synchronize()
        self._landed(work, (stop - start) * 2 * sum(n for _, _, n in work.job.blocks.runs))
        self._moved(work, start, stop)

    def _end(self, work: JobWork) -> None:
        self._succeed(work)  # the stream finished: the copy is the delivery

    def _release(self) -> None:
        del self._dst_rows, self._dst


class CudaIpcTransport(Transport):
    """``cuda_ipc``: regions in this process's GPU memory; writers copy GPU to GPU."""

    name = "cuda_ipc"
    source_on_device = True

    def __init__(self, device: str | None = None) -> None:
        _require_cuda()
        super().__init__()
        self.device = torch.device(device or "cuda")
        if self.device.type != "cuda":
            raise TransferError(f"cuda_ipc regions live on a CUDA device, not {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

    def _register(self, layout: KVLayout) -> KVRegion:
        return CudaIpcRegion(layout, self.device)

    def _open_writer(self, handle: MemoryRegionHandle, source: KVSource) -> CudaIpcWriter:
        return CudaIpcWriter(handle, source)

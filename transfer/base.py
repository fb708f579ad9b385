"""The KV data plane's interface: register a pool once, let peers write into it one-sided.

Target side (decode worker)::

    region = transport.register(layout)           # allocate + register the pool's memory
    cache = KVCache(layout.to_spec(), buffer=region.tensor)
    send region.handle.to_dict() with the destination block ids in the Prefill call

Initiator side (prefill worker)::

    writer = transport.connect(handle)            # cached per region_id
    job = writer.begin(request_id, deadline=time.monotonic() + 5.0)
    for layer in ...:                             # as each layer finishes
        job.write_blocks(layer, src_cache.as_bytes(), src_layout, src_ids, dst_ids)
    result = job.finish()                         # bytes are in the target's memory now

Lifecycle of one job (each stage is a queue owned by the writer's sender thread):
``begin`` -> writes queued (non-blocking) -> moved in order by the sender -> end queued by
``finish`` -> confirmed (shm: the copies are done; tcp: the receiver acknowledged the byte
count) -> ``finish`` returns a ``TransferResult``. A job fails at most once, with
``TransferTimeout`` (deadline passed) or ``TransferError`` (peer gone, connection broken,
aborted); after it failed, none of its queued writes starts.

Contract for the target: after a job failed, bytes of that job may still land in its
destination blocks for a short while (one range already in flight, or bytes already in a
socket buffer). The decode worker must not hand those blocks to another request until the
writer's deadline plus a grace period has passed (the lease of the failure model).

Why this shape admits RDMA unchanged: ``register`` is ``ibv_reg_mr`` over the pool's memory
(``handle.key`` = rkey, ``handle.address`` = remote virtual address plus the rdma_cm
``host:port`` a peer connects its RC queue pair to); ``connect`` creates and connects the
queue pair; ``write`` posts one RDMA WRITE per range (the source is registered once, like the
target); ``finish`` posts a final signalled WRITE-with-immediate and polls completions until
the deadline. No method here assumes a socket or a shared mapping.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from transfer.errors import TransferError
from transfer.handle import KVLayout, MemoryRegionHandle
from transfer.plan import BlockPlan, ByteRange, check_layer, plan_blocks


@dataclass(frozen=True)
class TransferResult:
    """One finished job: ``bytes`` confirmed in the target's memory over ``layers`` layers.

    ``seconds`` runs from the job's first write to its confirmation (it overlaps compute);
    ``wait_seconds`` is how long ``finish()`` blocked, the transfer's cost to time to first
    token.
    """

    bytes: int
    seconds: float
    layers: int
    wait_seconds: float


@dataclass(frozen=True)
class TransferStats:
    """Counters a service exports: ``bytes`` moved (also of jobs that later failed), summed
    ``seconds`` and count of successful ``jobs``, and ``failures`` (aborts excluded)."""

    bytes: int = 0
    seconds: float = 0.0
    jobs: int = 0
    failures: int = 0


class StatsCounter:
    """Thread-safe accumulator behind a ``TransferStats`` snapshot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = 0
        self._seconds = 0.0
        self._jobs = 0
        self._failures = 0

    def add_bytes(self, count: int) -> None:
        with self._lock:
            self._bytes += count

    def add_job(self, seconds: float) -> None:
        with self._lock:
            self._jobs += 1
            self._seconds += seconds

    def add_failure(self) -> None:
        with self._lock:
            self._failures += 1

    def snapshot(self) -> TransferStats:
        with self._lock:
            return TransferStats(self._bytes, self._seconds, self._jobs, self._failures)


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
        self._stats = StatsCounter()

    @property
    def layout(self) -> KVLayout:
        return self.handle.layout

    def stats(self) -> TransferStats:
        """What this side saw arrive (one-sided transports see nothing: zeros)."""
        return self._stats.snapshot()

    @property
    @abstractmethod
    def closed(self) -> bool: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> KVRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _CachedPlan:
    """The block plan ``write_blocks`` made for a job, with what it was made for.

    ``src_arg`` / ``dst_arg``: the id sequences exactly as passed when both are tuples
    (immutable), else None: the next call with the very same objects needs no comparison.
    A plain class with slots: every request makes one, on its first layer's path.
    """

    __slots__ = (
        "dst_arg", "dst_block_ids", "plan", "src", "src_arg", "src_block_ids", "src_fits",
        "src_layout",
    )  # fmt: skip

    def __init__(
        self,
        src_layout: KVLayout,
        src_block_ids: tuple[int, ...],
        dst_block_ids: tuple[int, ...],
        src: torch.Tensor,
        plan: BlockPlan,
        src_fits: bool,  # every layer of the plan lies inside ``src``
        src_arg: object,
        dst_arg: object,
    ) -> None:
        self.src_layout = src_layout
        self.src_block_ids = src_block_ids
        self.dst_block_ids = dst_block_ids
        self.src = src
        self.plan = plan
        self.src_fits = src_fits
        self.src_arg = src_arg
        self.dst_arg = dst_arg


class TransferJob(ABC):
    """The transfer of one request's KV into one region, begun by ``RegionWriter.begin``."""

    request_id: str
    deadline: float
    handle: MemoryRegionHandle
    _plan_cache: _CachedPlan | None = None

    @abstractmethod
    def write(self, layer: int, src: torch.Tensor, ranges: Sequence[ByteRange]) -> None:
        """Queue copies of ``src[s:s+n]`` to region bytes ``[d, d+n)`` for each ``(s, d, n)``.

        Non-blocking. ``src`` is the flat uint8 view of the local pool (``KVCache.as_bytes()``);
        its bytes in these ranges must not change until ``finish()`` returns. Ranges outside
        ``src`` or the region, a bad layer, or a job that already failed or finished raise
        ``TransferError`` and nothing of this call is queued.
        """

    def write_blocks(
        self,
        layer: int,
        src: torch.Tensor,
        src_layout: KVLayout,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
    ) -> None:
        """``write`` the ranges ``plan_ranges`` gives for these blocks of one layer.

        A request's block runs are the same in every layer; only the layer's base offset
        differs on each side. So the runs are planned once per job (``plan_blocks``, which
        checks the ids against both pools), and once ``src`` is known to hold the whole
        source pool, no write needs per-range checks: a layer's runs stay inside both pools
        because the layer does.
        """
        cached = self._plan_cache
        if (  # the same immutable ids, pool and layout as the last layer: the common case
            cached is None
            or cached.src_arg is not src_block_ids
            or cached.dst_arg is not dst_block_ids
            or cached.src is not src
            or cached.src_layout is not src_layout
        ):
            cached = self._plan_for(src, src_layout, src_block_ids, dst_block_ids)
        if layer.__class__ is not int or not 0 <= layer < src_layout.num_layers:
            check_layer(layer, src_layout.num_layers)  # raises, naming the layer
        if cached.src_fits:
            self._write_planned(layer, src, cached.plan)
        else:
            self.write(layer, src, cached.plan.ranges(layer))  # full checks, clear errors

    def _plan_for(
        self,
        src: torch.Tensor,
        src_layout: KVLayout,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
    ) -> _CachedPlan:
        """The job's plan for these arguments: the cached one when the ids, pool and layout
        are equal to its own, else a new plan (``plan_blocks`` checks the ids)."""
        src_ids, dst_ids = tuple(src_block_ids), tuple(dst_block_ids)
        immutable = type(src_block_ids) is tuple and type(dst_block_ids) is tuple
        src_arg, dst_arg = (src_block_ids, dst_block_ids) if immutable else (None, None)
        cached = self._plan_cache
        if (
            cached is None
            or cached.src is not src
            or cached.src_block_ids != src_ids
            or cached.dst_block_ids != dst_ids
            or (cached.src_layout is not src_layout and cached.src_layout != src_layout)
        ):
            plan = plan_blocks(src_layout, self.handle.layout, src_ids, dst_ids)
            fits = self._source_fits(src, src_layout)
        else:
            plan, fits = cached.plan, cached.src_fits
        cached = _CachedPlan(src_layout, src_ids, dst_ids, src, plan, fits, src_arg, dst_arg)
        self._plan_cache = cached
        return cached

    def _source_fits(self, src: torch.Tensor, src_layout: KVLayout) -> bool:
        """Whether ``src`` is a source this transport takes that holds all of a pool of
        ``src_layout`` (then every planned range lies inside it). False sends writes through
        ``write``, whose checks name what is wrong."""
        return False

    def _write_planned(self, layer: int, src: torch.Tensor, plan: BlockPlan) -> None:
        """``write`` of ``plan``'s ranges of ``layer``, which ``write_blocks`` vouches for
        (``layer`` is in range, the plan's ranges lie inside ``src`` and the region).
        Transports may skip their per-range checks, or copy by runs."""
        self.write(layer, src, plan.ranges(layer))

    @abstractmethod
    def finish(self) -> TransferResult:
        """Block until every queued write is confirmed in the target's memory.

        Raises ``TransferTimeout`` once the deadline passes (never later than the deadline
        plus scheduling slack) and ``TransferError`` if the peer or connection failed or the
        job was aborted. Call at most once.
        """

    @abstractmethod
    def abort(self) -> None:
        """Fail the job now; queued writes are dropped. Idempotent, never blocks."""


class RegionWriter(ABC):
    """An initiator's open path into one remote region; runs any number of jobs."""

    def __init__(self, handle: MemoryRegionHandle) -> None:
        self.handle = handle

    @abstractmethod
    def begin(self, request_id: str, *, deadline: float) -> TransferJob:
        """Start a job; ``deadline`` is absolute ``time.monotonic()`` seconds of this process.

        Raises ``TransferError`` if the writer is closed, the target is known to be gone, or
        ``request_id`` already has a job in flight on this writer.
        """

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

    Writers are cached per ``region_id``: ``connect`` with the same handle returns the same
    open writer. ``close`` closes every writer and region this transport made.
    """

    name: ClassVar[str]

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writers: dict[str, RegionWriter] = {}
        self._regions: list[KVRegion] = []

    @abstractmethod
    def _register(self, layout: KVLayout) -> KVRegion: ...

    @abstractmethod
    def _open_writer(self, handle: MemoryRegionHandle) -> RegionWriter: ...

    def register(self, layout: KVLayout) -> KVRegion:
        """Allocate and register memory for a pool of ``layout``; raises ``TransferError``."""
        region = self._register(layout)
        with self._lock:
            self._regions = [r for r in self._regions if not r.closed]
            self._regions.append(region)
        return region

    def connect(self, handle: MemoryRegionHandle) -> RegionWriter:
        """An open writer into ``handle``'s region; raises ``TransferError`` if unreachable."""
        if handle.transport != self.name:
            raise TransferError(
                f"handle is for transport {handle.transport!r}, this is {self.name!r}"
            )
        with self._lock:
            cached = self._writers.get(handle.region_id)
            if cached is not None and not cached.closed and cached.handle == handle:
                return cached
        # Opening may block (a TCP connect): not under the lock; a racing opener loses.
        writer = self._open_writer(handle)
        with self._lock:
            current = self._writers.get(handle.region_id)
            if current is not None and not current.closed and current.handle == handle:
                loser, writer = writer, current
            else:
                loser = current
                self._writers[handle.region_id] = writer
        if loser is not None:
            loser.close()
        return writer

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

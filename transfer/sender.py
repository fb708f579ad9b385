"""The job machinery transports share: validate writes, queue them, move them in order.

Each ``QueuedWriter`` owns one sender thread and one FIFO of operations (write, end, abort
notice). ``write`` validates and enqueues, so the model's next layer computes while this
layer's bytes move; the sender thread runs the transport's ``_move`` / ``_end`` hooks in
order; the transport confirms a job with ``_complete`` or fails it with ``_fail`` (from any
thread; the first outcome wins). ``finish`` waits on the job's event until its deadline.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from transfer.base import RegionWriter, StatsCounter, TransferJob, TransferResult, TransferStats
from transfer.errors import TransferError, TransferTimeout
from transfer.handle import MemoryRegionHandle
from transfer.plan import ByteRange


class QueuedJob(TransferJob):
    """State of one job; the writer's lock guards the fields other threads change."""

    def __init__(self, writer: QueuedWriter, request_id: str, deadline: float) -> None:
        self.request_id = request_id
        self.deadline = deadline
        self.handle = writer.handle
        self._writer = writer
        self.done = threading.Event()
        self.error: TransferError | None = None
        self.terminal = False
        self.finish_called = False
        self.bytes_queued = 0
        self.bytes_moved = 0  # written by the sender thread only
        self.layers: set[int] = set()
        self.begun_at = time.monotonic()
        self.first_write_at: float | None = None
        self.completed_at: float | None = None
        self.transport_state: Any = None  # e.g. the TCP connection the job's frames went on

    def write(self, layer: int, src: torch.Tensor, ranges: Sequence[ByteRange]) -> None:
        self._writer._enqueue_write(self, layer, src, ranges)

    def finish(self) -> TransferResult:
        return self._writer._finish(self)

    def abort(self) -> None:
        self._writer._fail(self, TransferError(f"transfer of {self.request_id!r} aborted"), True)

    def __repr__(self) -> str:
        return f"QueuedJob({self.request_id!r}, region={self.handle.region_id})"


@dataclass(frozen=True)
class _WriteOp:
    job: QueuedJob
    layer: int
    src: torch.Tensor
    ranges: tuple[ByteRange, ...]


@dataclass(frozen=True)
class _EndOp:
    job: QueuedJob


@dataclass(frozen=True)
class _FailedNotice:
    job: QueuedJob


_Op = _WriteOp | _EndOp | _FailedNotice


class QueuedWriter(RegionWriter):
    """A ``RegionWriter`` whose jobs run on one sender thread; transports fill in the hooks.

    Subclasses call ``_start()`` at the end of their ``__init__``.
    """

    accepts_device_tensors: ClassVar[bool] = False

    def __init__(self, handle: MemoryRegionHandle) -> None:
        super().__init__(handle)
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._active: dict[str, QueuedJob] = {}
        self._counter = StatsCounter()
        self._closed = False
        self._thread: threading.Thread | None = None

    # --- hooks -------------------------------------------------------------------------

    def _check_alive(self) -> None:
        """Raise ``TransferError`` if the target is known to be gone (called by ``begin``)."""

    @abstractmethod
    def _move(self, job: QueuedJob, src: torch.Tensor, ranges: tuple[ByteRange, ...]) -> None:
        """Sender thread: move ranges in order, calling ``_moved`` as bytes go out."""

    @abstractmethod
    def _end(self, job: QueuedJob) -> None:
        """Sender thread: every write of ``job`` has been moved; confirm it (now or later)."""

    def _on_failed(self, job: QueuedJob) -> None:
        """Sender thread: ``job`` failed; tell the target if the transport needs to."""

    def _interrupt(self) -> None:
        """Any thread, on close: unblock the sender if it waits on I/O."""

    def _release(self) -> None:
        """On close, after the sender thread stopped: release the transport's resources."""

    # --- RegionWriter ------------------------------------------------------------------

    def _start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"kv-send-{self.handle.region_id[:8]}", daemon=True
        )
        self._thread.start()

    def begin(self, request_id: str, *, deadline: float) -> TransferJob:
        if not isinstance(request_id, str) or not request_id:
            raise TransferError(f"request_id must be a non-empty string, got {request_id!r}")
        if (
            not isinstance(deadline, int | float)
            or isinstance(deadline, bool)
            or math.isnan(deadline)
        ):
            raise TransferError(f"deadline must be time.monotonic() seconds, got {deadline!r}")
        if self._closed:
            raise TransferError(f"writer to region {self.handle.region_id} is closed")
        self._check_alive()
        stale = self._active.get(request_id)
        if stale is not None and time.monotonic() > stale.deadline:
            # Its owner never called finish() or abort(); past its deadline it is dead anyway.
            self._fail(stale, self._timeout(stale))
        with self._lock:
            if self._closed:
                raise TransferError(f"writer to region {self.handle.region_id} is closed")
            if request_id in self._active:
                raise TransferError(f"request {request_id!r} already has a transfer in flight")
            job = QueuedJob(self, request_id, float(deadline))
            self._active[request_id] = job
        return job

    def stats(self) -> TransferStats:
        return self._counter.snapshot()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            jobs = list(self._active.values())
        for job in jobs:
            self._fail(job, TransferError(f"writer to region {self.handle.region_id} closed"))
        self._queue.put(None)
        self._interrupt()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._release()

    # --- job operations ------------------------------------------------------------------

    def _check_ranges(
        self, layer: int, src: torch.Tensor, ranges: Sequence[ByteRange]
    ) -> tuple[ByteRange, ...]:
        layout = self.handle.layout
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise TransferError(f"layer must be an int, got {layer!r}")
        if not 0 <= layer < layout.num_layers:
            raise TransferError(f"layer {layer} outside [0, {layout.num_layers})")
        if (
            not isinstance(src, torch.Tensor)
            or src.dtype != torch.uint8
            or src.dim() != 1
            or not src.is_contiguous()
        ):
            raise TransferError("src must be a flat contiguous uint8 tensor (KVCache.as_bytes())")
        if src.device.type != "cpu" and not self.accepts_device_tensors:
            raise TransferError(f"{type(self).__name__} needs a CPU source, got {src.device}")
        src_len, dst_len = src.numel(), self.handle.length
        checked: list[ByteRange] = []
        for item in ranges:
            if (
                not isinstance(item, tuple | list)
                or len(item) != 3
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in item)
            ):
                raise TransferError(f"range must be (src_offset, dst_offset, length), got {item!r}")
            s, d, n = item
            if s < 0 or d < 0 or n < 0:
                raise TransferError(f"range {item!r} has a negative field")
            if s + n > src_len:
                raise TransferError(f"source bytes [{s}, {s + n}) outside the {src_len}-byte src")
            if d + n > dst_len:
                raise TransferError(
                    f"destination bytes [{d}, {d + n}) outside region {self.handle.region_id} "
                    f"of {dst_len} bytes"
                )
            if n:
                checked.append((s, d, n))
        return tuple(checked)

    def _enqueue_write(
        self, job: QueuedJob, layer: int, src: torch.Tensor, ranges: Sequence[ByteRange]
    ) -> None:
        checked = self._check_ranges(layer, src, ranges)
        if time.monotonic() > job.deadline:
            self._fail(job, self._timeout(job))
        with self._lock:
            if job.error is not None:
                raise job.error
            if job.finish_called or job.terminal:
                raise TransferError(f"transfer of {job.request_id!r} already finished")
            if self._closed:
                raise TransferError(f"writer to region {self.handle.region_id} is closed")
            job.bytes_queued += sum(n for _, _, n in checked)
            job.layers.add(layer)
            if job.first_write_at is None:
                job.first_write_at = time.monotonic()
            # Under the lock: a concurrent close() must see this op queued before its sentinel.
            self._queue.put(_WriteOp(job, layer, src, checked))

    def _finish(self, job: QueuedJob) -> TransferResult:
        with self._lock:
            if job.finish_called:
                raise TransferError(f"finish() already called for {job.request_id!r}")
            job.finish_called = True
            if not job.terminal:
                self._queue.put(_EndOp(job))
        started = time.monotonic()
        if not job.done.wait(max(0.0, job.deadline - started)):
            self._fail(job, self._timeout(job))
        waited = time.monotonic() - started
        if job.error is not None:
            raise job.error
        completed = job.completed_at if job.completed_at is not None else time.monotonic()
        first = job.first_write_at if job.first_write_at is not None else job.begun_at
        return TransferResult(
            bytes=job.bytes_moved,
            seconds=completed - first,
            layers=len(job.layers),
            wait_seconds=waited,
        )

    def _timeout(self, job: QueuedJob) -> TransferTimeout:
        return TransferTimeout(
            f"transfer of {job.request_id!r} to region {self.handle.region_id} missed its "
            f"deadline: {job.bytes_moved} of {job.bytes_queued} bytes moved"
            + (", awaiting confirmation" if job.finish_called else "")
        )

    def _moved(self, job: QueuedJob, count: int) -> None:
        job.bytes_moved += count
        self._counter.add_bytes(count)

    def _complete(self, job: QueuedJob) -> None:
        with self._lock:
            if job.terminal:
                return
            job.terminal = True
            job.completed_at = time.monotonic()
            if self._active.get(job.request_id) is job:
                del self._active[job.request_id]
            first = job.first_write_at if job.first_write_at is not None else job.begun_at
            self._counter.add_job(job.completed_at - first)
        job.done.set()

    def _fail(self, job: QueuedJob, error: TransferError, aborted: bool = False) -> None:
        with self._lock:
            if job.terminal:
                return
            job.terminal = True
            job.error = error
            if self._active.get(job.request_id) is job:
                del self._active[job.request_id]
            if not aborted:
                self._counter.add_failure()
            if not self._closed:
                self._queue.put(_FailedNotice(job))
        job.done.set()

    def _run(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            job = op.job
            try:
                if isinstance(op, _FailedNotice):
                    self._on_failed(job)
                    continue
                if job.terminal:
                    continue
                if time.monotonic() > job.deadline:
                    self._fail(job, self._timeout(job))
                elif isinstance(op, _WriteOp):
                    self._move(job, op.src, op.ranges)
                else:
                    self._end(job)
            except TransferError as exc:
                self._fail(job, exc)
            except Exception as exc:  # an OS or library error must fail the job, not the thread
                self._fail(job, TransferError(f"transfer of {job.request_id!r} failed: {exc!r}"))

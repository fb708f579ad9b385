"""The job machinery transports share: validate writes, queue them, move them in order.

Each ``QueuedWriter`` owns one sender thread. ``write`` validates a write and appends it to
its job's list of unmoved writes; when the caller computes between writes (the next write
comes ``WAKE_GAP_S`` or more after the previous one), the job is put on the sender's FIFO,
so the model's next layer computes while the earlier layers' bytes move. The sender takes
a job's unmoved writes (all of them: a batch) and runs the transport's ``_move`` hook.

``finish`` does not hand the job's tail to the sender: the compute it overlapped with is
over, so the calling thread takes the writes the sender has not started, moves them itself
(``_move_here``; after the sender's batch in flight, if any: one thread at a time moves a
job's bytes, in order) and runs ``_end``. The transport confirms a job with ``_complete``
(in ``_end``, or later from its own thread: the tcp ack reader) or fails it with ``_fail``
(from any thread; the first outcome wins); ``finish`` returns at once if the outcome is in,
else waits for it (on a lock it makes then, which the outcome releases) until the deadline.
When ``finish`` follows the writes at once (a prefill that outran the transfer), the caller
moves everything and no thread hand-off is on the request's path; writes of consecutive
layers that come back to back extend one queued write, without the writer's lock while the
sender holds none of the job's writes (``QueuedJob.open_tail``).

Lifecycle of one job: begun -> writes unmoved (on the job's list) -> moving (sender or
finisher) -> ended (``_end`` ran) -> confirmed / failed.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from transfer.base import RegionWriter, TransferJob, TransferResult, TransferStats
from transfer.errors import TransferError, TransferTimeout
from transfer.handle import KVLayout, MemoryRegionHandle
from transfer.plan import BlockPlan, ByteRange

# The sender thread is handed a job's writes when the caller shows it does other work
# between writes (the model computing the next layer): a write that comes this long after
# the job's previous one. Writes that come back to back (nothing to overlap with, finish()
# is near) stay with the caller, and finish() moves them without waking a thread.
WAKE_GAP_S = 50e-6

_NUMBER = (int, float)
# The clock writes are stamped with (WAKE_GAP_S apart or not); a module global, so a test
# can drive it.
_monotonic = time.monotonic


class QueuedJob(TransferJob):
    """State of one job; the writer's lock guards the fields other threads change.

    Every request makes a job and runs its few calls with cold caches (the previous
    request's copy evicted them): fields that start at a constant are class attributes until
    first assigned, the layers written are a bit mask, not a set, and the job has no event
    of its own (``finish`` makes a lock to wait on only when the job is not confirmed by the
    time it would wait).
    """

    error: TransferError | None = None
    terminal = False  # confirmed or failed (set once, under the writer's lock)
    finish_called = False
    bytes_queued = 0
    bytes_moved = 0  # written by the one thread moving the job's bytes
    bytes_counted = 0  # of bytes_moved, what the writer's stats hold (under its lock)
    layer_mask = 0  # bit i: layer i was written
    first_write_at: float | None = None
    last_write_at: float | None = None
    completed_at: float | None = None
    transport_state: Any = None  # e.g. the TCP connection the job's frames went on
    scheduled = False  # on the sender's FIFO
    moving = False  # the sender is moving a batch of this job now
    claimed = False  # finish() moves the rest; the sender leaves the job alone
    waiter: threading.Lock | None = None  # held until the job turns terminal; finish waits
    # The planned write that ``_write_planned`` may extend by the next layer without taking
    # the writer's lock: set (under the lock) when a planned write is queued while the job
    # is not on the sender's FIFO, so no other thread can take that write; cleared (under
    # the lock) when the job is scheduled, finished or failed. Only the thread writing the
    # job's layers reads it.
    open_tail: Write | None = None

    def __init__(self, writer: QueuedWriter, request_id: str, deadline: float) -> None:
        self.request_id = request_id
        self.deadline = deadline
        self.handle = writer.handle
        self._writer = writer
        self.begun_at = time.monotonic()
        self.unmoved: list[Write] = []

    def write(self, layer: int, src: torch.Tensor, ranges: Sequence[ByteRange]) -> None:
        checked = self._writer._check_ranges(layer, src, ranges)
        nbytes = sum(n for _, _, n in checked)
        self._writer._enqueue(self, layer, src, nbytes, checked, None)

    def _source_fits(self, src: torch.Tensor, src_layout: KVLayout) -> bool:
        return self._writer._source_fits(src, src_layout)

    def _write_planned(self, layer: int, src: torch.Tensor, plan: BlockPlan) -> None:
        # ``write_blocks`` vouches for the plan's ranges of this layer. The next layer of the
        # open write, back to back (a layer's compute takes longer than WAKE_GAP_S, so this
        # is a prefill that computed several layers before writing them, or a benchmark):
        # extend it as ``_enqueue`` would, without its lock (see ``open_tail``). This is
        # most of a small request's writes.
        tail = self.open_tail
        if tail is not None and layer == tail.stop and tail.plan is plan and tail.src is src:
            now = _monotonic()
            if now - self.last_write_at < WAKE_GAP_S and now <= self.deadline:  # type: ignore[operator]
                nbytes = plan.layer_bytes
                tail.stop = layer + 1
                tail.nbytes += nbytes
                self.bytes_queued += nbytes
                self.layer_mask |= 1 << layer
                self.last_write_at = now
                return
        self._writer._enqueue(self, layer, src, plan.layer_bytes, None, plan)

    def finish(self) -> TransferResult:
        return self._writer._finish(self)

    def abort(self) -> None:
        self._writer._fail(self, TransferError(f"transfer of {self.request_id!r} aborted"), True)

    def __repr__(self) -> str:
        return f"QueuedJob({self.request_id!r}, region={self.handle.region_id})"


class Write:
    """One queued write: explicit ``ranges``, or ``plan``'s ranges of layers ``[layer,
    stop)`` (what ``write_blocks`` queues: consecutive layers of one plan queued before the
    mover took them are one ``Write``, and a transport may copy a plan's runs over all of
    those layers at once)."""

    __slots__ = ("_ranges", "layer", "nbytes", "plan", "src", "stop")

    def __init__(
        self,
        src: torch.Tensor,
        nbytes: int,
        ranges: Sequence[ByteRange] | None,
        plan: BlockPlan | None = None,
        layer: int = -1,
    ) -> None:
        self.src = src
        self.nbytes = nbytes
        self._ranges = ranges
        self.plan = plan
        self.layer = layer
        self.stop = layer + 1

    @property
    def ranges(self) -> Sequence[ByteRange]:
        if self._ranges is None:
            plan = self.plan
            assert plan is not None
            if self.stop == self.layer + 1:
                self._ranges = plan.ranges(self.layer)
            else:
                self._ranges = [r for i in range(self.layer, self.stop) for r in plan.ranges(i)]
        return self._ranges


@dataclass(frozen=True)
class _FailedNotice:
    job: QueuedJob


def flat_batches(
    writes: Sequence[Write],
) -> list[tuple[torch.Tensor, Sequence[ByteRange], int]]:
    """Consecutive writes from one source merged: ``(src, ranges, nbytes)`` in order."""
    out: list[tuple[torch.Tensor, Sequence[ByteRange], int]] = []
    start = 0
    while start < len(writes):
        src = writes[start].src
        stop = start + 1
        while stop < len(writes) and writes[stop].src is src:
            stop += 1
        if stop == start + 1:
            out.append((src, writes[start].ranges, writes[start].nbytes))
        else:
            run = writes[start:stop]
            out.append((src, [r for w in run for r in w.ranges], sum(w.nbytes for w in run)))
        start = stop
    return out


class QueuedWriter(RegionWriter):
    """A ``RegionWriter`` whose jobs run on one sender thread; transports fill in the hooks.

    ``_move`` may run on the sender for one job while ``_move_here`` or ``_end`` runs on a
    finishing thread for another: transports keep whatever they share (a socket) safe.
    Subclasses call ``_start()`` at the end of their ``__init__``.
    """

    accepts_device_tensors: ClassVar[bool] = False

    def __init__(self, handle: MemoryRegionHandle) -> None:
        super().__init__(handle)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # a job's sender batch ended
        self._queue: queue.SimpleQueue[QueuedJob | _FailedNotice | None] = queue.SimpleQueue()
        self._active: dict[str, QueuedJob] = {}
        # The stats, under the lock. A job's moved bytes join them at points that hold the
        # lock anyway (a sender batch's end, the job's outcome), not once per copy.
        self._bytes = 0
        self._seconds = 0.0
        self._jobs = 0
        self._failures = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._fits: tuple[object, KVLayout, bool] | None = None

    # --- hooks -------------------------------------------------------------------------

    def _check_alive(self) -> None:
        """Raise ``TransferError`` if the target is known to be gone (called by ``begin``)."""

    @abstractmethod
    def _move(self, job: QueuedJob, writes: Sequence[Write]) -> None:
        """Sender thread: move ``writes`` (a job's, in order), calling ``_moved`` as bytes
        go out (once per call is enough; when it stops early, for what it moved). Stops
        when the job turns terminal; raises ``TransferTimeout`` past its deadline."""

    def _move_here(self, job: QueuedJob, writes: Sequence[Write]) -> None:
        """``_move`` on the thread calling finish(): nothing computes alongside any more, so
        a transport may trade overlap for speed here."""
        self._move(job, writes)

    @abstractmethod
    def _end(self, job: QueuedJob) -> None:
        """finish()'s thread: every write of ``job`` has been moved; confirm it now
        (``_complete``) or arrange for it to be confirmed before its deadline."""

    def _on_failed(self, job: QueuedJob) -> None:
        """Sender thread: ``job``, which has ``transport_state``, failed; tell the target if
        the transport needs to."""

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
        # Exact-type checks first: the common case costs two comparisons (NaN != NaN).
        if request_id.__class__ is not str or not request_id:
            if not isinstance(request_id, str) or not request_id:
                raise TransferError(f"request_id must be a non-empty string, got {request_id!r}")
        if deadline.__class__ is not float or deadline != deadline:
            if (
                not isinstance(deadline, _NUMBER)
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
        with self._lock:
            return TransferStats(self._bytes, self._seconds, self._jobs, self._failures)

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

    def _source_fits(self, src: object, src_layout: KVLayout) -> bool:
        """Whether ``write`` takes ``src`` (the checks ``_check_ranges`` makes of it) and
        ``src`` holds a whole pool of ``src_layout``. The answer for the last pool asked
        about is kept: a worker writes from one pool tensor for its whole life."""
        cached = self._fits
        if cached is not None and cached[0] is src and cached[1] is src_layout:
            return cached[2]
        fits = (
            isinstance(src, torch.Tensor)
            and src.dtype == torch.uint8
            and src.dim() == 1
            and src.is_contiguous()
            and (src.device.type == "cpu" or self.accepts_device_tensors)
            and src.numel() >= src_layout.total_bytes
        )
        self._fits = (src, src_layout, fits)
        return fits

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

    def _enqueue(
        self,
        job: QueuedJob,
        layer: int,
        src: torch.Tensor,
        nbytes: int,
        ranges: Sequence[ByteRange] | None,
        plan: BlockPlan | None,
    ) -> None:
        """Queue a write whose ranges are known to lie inside its source and the region:
        explicit ``ranges``, or ``plan``'s ranges of ``layer``. A planned write of the layer
        after the job's last unmoved one, same plan and source, extends that one."""
        now = _monotonic()
        if now > job.deadline:
            self._fail(job, self._timeout(job))
        with self._lock:
            if job.error is not None:
                raise job.error
            if job.finish_called or job.terminal:
                raise TransferError(f"transfer of {job.request_id!r} already finished")
            if self._closed:
                raise TransferError(f"writer to region {self.handle.region_id} is closed")
            job.bytes_queued += nbytes
            job.layer_mask |= 1 << layer
            last_at = job.last_write_at
            job.last_write_at = now
            unmoved = job.unmoved
            tail = unmoved[-1] if unmoved else None
            if (
                plan is not None
                and tail is not None
                and tail.plan is plan
                and tail.stop == layer
                and tail.src is src
            ):
                tail.stop = layer + 1
                tail.nbytes += nbytes
            else:
                unmoved.append(Write(src, nbytes, ranges, plan, layer))
            if last_at is None:
                job.first_write_at = now
            elif now - last_at >= WAKE_GAP_S and not job.scheduled:
                job.scheduled = True
                # Under the lock: a concurrent close() must see the job queued before its
                # sentinel.
                self._queue.put(job)
            # Not scheduled: the job is not on the FIFO and the sender holds none of its
            # unmoved writes (it took them under this lock), so the caller may extend this one.
            job.open_tail = unmoved[-1] if plan is not None and not job.scheduled else None

    def _finish(self, job: QueuedJob) -> TransferResult:
        started = time.monotonic()
        self._finish_here(job)
        if not job.terminal:  # set once, never unset: no lock needed to see it set
            self._await_outcome(job)
        waited = time.monotonic() - started
        if job.error is not None:
            raise job.error
        completed = job.completed_at if job.completed_at is not None else time.monotonic()
        first = job.first_write_at if job.first_write_at is not None else job.begun_at
        return TransferResult(
            bytes=job.bytes_moved,
            seconds=completed - first,
            layers=job.layer_mask.bit_count(),
            wait_seconds=waited,
        )

    def _finish_here(self, job: QueuedJob) -> None:
        """On the thread calling finish(): move the writes the sender has not started, then
        end the job. Waits (deadlined) for the sender's batch of this job in flight first."""
        with self._lock:
            if job.finish_called:
                raise TransferError(f"finish() already called for {job.request_id!r}")
            job.finish_called = True
            job.open_tail = None
            job.claimed = True  # from now on the sender leaves this job alone
            while job.moving and not job.terminal:
                left = job.deadline - time.monotonic()
                if left <= 0:
                    break
                self._idle.wait(left)
            writes = job.unmoved
            job.unmoved = []
        try:
            if writes:
                self._check_live(job)
                self._move_here(job, writes)
            self._check_live(job)
            if not job.terminal:
                self._end(job)
        except _Stopped:
            pass
        except TransferError as exc:
            self._fail(job, exc)
        except Exception as exc:  # an OS or library error fails the job, as on the sender
            self._fail(job, TransferError(f"transfer of {job.request_id!r} failed: {exc!r}"))
        # This thread moved the job's last bytes. An outcome that came first (a tcp ack read
        # before the last frame was counted, a failure mid-copy) left some out of the stats.
        if job.bytes_counted != job.bytes_moved:
            with self._lock:
                self._count_moved(job)

    def _await_outcome(self, job: QueuedJob) -> None:
        """Block until ``job`` is confirmed or failed; fail it at its deadline."""
        with self._lock:
            if job.terminal:
                return
            waiter = job.waiter = threading.Lock()
            waiter.acquire()
        if not waiter.acquire(timeout=max(0.0, job.deadline - time.monotonic())):
            self._fail(job, self._timeout(job))

    def _check_live(self, job: QueuedJob) -> None:
        if job.terminal:
            raise _Stopped
        if time.monotonic() > job.deadline:
            raise self._timeout(job)

    def _timeout(self, job: QueuedJob, moving: int = 0) -> TransferTimeout:
        """The job's deadline error; ``moving``: bytes moved but not yet counted."""
        return TransferTimeout(
            f"transfer of {job.request_id!r} to region {self.handle.region_id} missed its "
            f"deadline: {job.bytes_moved + moving} of {job.bytes_queued} bytes moved"
            + (", awaiting confirmation" if job.finish_called else "")
        )

    def _moved(self, job: QueuedJob, count: int) -> None:
        job.bytes_moved += count

    def _count_moved(self, job: QueuedJob) -> None:
        """Add ``job``'s bytes moved since the last call to the stats (lock held)."""
        self._bytes += job.bytes_moved - job.bytes_counted
        job.bytes_counted = job.bytes_moved

    def _complete(self, job: QueuedJob) -> None:
        with self._lock:
            if job.terminal:
                return
            job.terminal = True
            job.completed_at = time.monotonic()
            if self._active.get(job.request_id) is job:
                del self._active[job.request_id]
            first = job.first_write_at if job.first_write_at is not None else job.begun_at
            self._jobs += 1
            self._seconds += job.completed_at - first
            self._count_moved(job)
            if job.waiter is not None:
                job.waiter.release()

    def _fail(self, job: QueuedJob, error: TransferError, aborted: bool = False) -> None:
        with self._lock:
            if job.terminal:
                return
            job.terminal = True
            job.error = error
            job.open_tail = None
            job.unmoved.clear()
            if self._active.get(job.request_id) is job:
                del self._active[job.request_id]
            if not aborted:
                self._failures += 1
            self._count_moved(job)
            if not self._closed and job.transport_state is not None:
                self._queue.put(_FailedNotice(job))  # the target may hold state for it
            self._idle.notify_all()
            if job.waiter is not None:
                job.waiter.release()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, _FailedNotice):
                # A notice is best effort: the job has failed already, whatever happens here.
                with contextlib.suppress(Exception):
                    self._on_failed(item.job)
                continue
            job = item
            with self._lock:
                job.scheduled = False
                if job.claimed or job.terminal or not job.unmoved:
                    continue
                writes = job.unmoved
                job.unmoved = []
                job.moving = True
            try:
                self._check_live(job)
                self._move(job, writes)
            except _Stopped:
                pass
            except TransferError as exc:
                self._fail(job, exc)
            except Exception as exc:  # an OS or library error must fail the job, not the thread
                self._fail(job, TransferError(f"transfer of {job.request_id!r} failed: {exc!r}"))
            finally:
                with self._lock:
                    job.moving = False
                    self._count_moved(job)
                    if job.claimed:
                        self._idle.notify_all()


class _Stopped(Exception):
    """The job turned terminal (aborted, failed elsewhere): stop moving its bytes."""

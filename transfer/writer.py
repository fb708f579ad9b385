"""One owner thread per writer: it alone touches the writer's mapping or socket and every
job's progress; other threads only post messages to it.

Messages (any thread -> owner, through one queue and a wake-up eventfd): ``begin``,
``layer``, ``finish``, ``abort``. The owner's loop: take the messages -> move the bytes of
written layers (the transport's ``_move``) -> fail jobs past their deadline -> wait for a
message, socket readiness or the next deadline.

Lifecycle of one job, each stage a set the owner keeps: begun -> started (the transport
checked its target, ``_start``) -> layers pending (written, not moved) -> moved -> ending
(``finish`` came and every written layer moved: ``_end``) -> SUCCESS (the transport
confirmed it: ``_succeed``), or FAILED at any point (``_fail``: deadline, abort, peer gone).
A failed job's outcome resolves once the transport holds none of its bytes in motion and
knows whether any can still land (``_drop``: QUIET, UNKNOWN, or DRAINING until the
transport calls ``_resolve``; a job still draining ``DRAIN_TIMEOUT_S`` later is given up:
``_give_up``, then resolved not quiet).
"""

from __future__ import annotations

import enum
import os
import queue
import selectors
import threading
import time
import weakref
from abc import abstractmethod
from collections.abc import Callable

import structlog

from transfer.base import (
    KVSource,
    RegionWriter,
    TransferJob,
    TransferResult,
    TransferStats,
)
from transfer.block_runs import check_layer
from transfer.errors import TransferError, TransferTimeout
from transfer.faults import InjectedFault
from transfer.handle import MemoryRegionHandle

log = structlog.get_logger(__name__)

_CLOSE_TIMEOUT_S = 5.0
# How long a failed job may wait for its transport to confirm what became of its bytes in
# flight (a receiver's answer to an abort) before it is resolved as not quiet.
DRAIN_TIMEOUT_S = 2.0


class Drop(enum.Enum):
    """What dropping a failed job left behind (``OwnerThreadWriter._drop``)."""

    QUIET = "quiet"  # no byte of it can land any more: resolve now, quiet
    UNKNOWN = "unknown"  # bytes in flight whose fate nobody will learn: resolve now, not quiet
    DRAINING = "draining"  # the transport resolves it once it knows (or it is given up)


class Owned:
    """State that one thread alone may change: the thread that made the object.

    ``check_owners()`` (the tests call it) makes setting an attribute from any other thread
    fail an assert; unchecked, the state costs what any object does.
    """

    def __init__(self) -> None:
        object.__setattr__(self, "_owner", threading.get_ident())


def _set_on_owner_thread(self: Owned, name: str, value: object) -> None:
    assert threading.get_ident() == self._owner, (  # type: ignore[attr-defined]
        f"{type(self).__name__}.{name} set off its owner thread"
    )
    object.__setattr__(self, name, value)


def check_owners(enabled: bool = True) -> None:
    """Turn the owner-thread assert of every ``Owned`` attribute write on (or off again)."""
    if enabled:
        Owned.__setattr__ = _set_on_owner_thread  # type: ignore[method-assign,assignment]
    elif "__setattr__" in Owned.__dict__:
        del Owned.__setattr__


class JobWork(Owned):
    """A job's progress, made and changed by its writer's owner thread only."""

    def __init__(self, job: TransferJob) -> None:
        super().__init__()
        self.job = job
        self.written = 0  # bit i: layer i was written
        self.pending = 0  # written, not yet moved
        self.bytes_moved = 0
        self.landings: list[tuple[float, int]] = []  # (when, bytes_moved then), in order
        self.ending = False  # finish() came
        self.ended = False  # _end ran
        self.error: TransferError | None = None  # set once: the job failed
        self.first_write_at: float | None = None
        self.finish_at: float | None = None
        self.last_layer_at = 0.0  # when the caller handed over its latest layer
        self.faults: tuple[bool, bool, bool] | None = None  # (fail, stall, drop), when drawn

    @property
    def done(self) -> bool:
        return self.error is not None or self.job.outcome.done()


def lowest_run(mask: int) -> tuple[int, int]:
    """``(start, stop)`` of the lowest run of set bits in ``mask`` (> 0): layers to move
    together."""
    start = (mask & -mask).bit_length() - 1
    stop = start
    while mask >> stop & 1:
        stop += 1
    return start, stop


class OwnerThreadWriter(RegionWriter):
    """A ``RegionWriter`` whose jobs live on one owner thread; transports fill in the hooks,
    which all run on that thread. Subclasses call ``_launch()`` at the end of ``__init__``."""

    def __init__(self, handle: MemoryRegionHandle, source: KVSource) -> None:
        super().__init__(handle, source)
        self._inbox: queue.SimpleQueue[tuple[str, TransferJob, object]] = queue.SimpleQueue()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # Closed when the writer is collected, never by close(): a late post from another
        # thread must not write into a reused descriptor.
        weakref.finalize(self, os.close, self._wake)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake, selectors.EVENT_READ, self._on_wake)
        # Orders posts against close(): a message posted before ``_closed`` is set is in the
        # inbox when the owner takes its last messages, so every begun job gets an outcome.
        self._post_lock = threading.Lock()
        self._closed = False  # set once, by close() or the owner on its way out
        self._works: dict[str, JobWork] = {}  # owner thread only; in begin order
        self._draining: dict[JobWork, float] = {}  # failed, awaiting _resolve: give-up time
        self._stats = TransferStats()  # replaced whole by the owner; read by anyone
        self._thread = threading.Thread(
            target=self._run, name=f"kv-writer-{handle.region_id[:8]}", daemon=True
        )

    def _launch(self) -> None:
        self._thread.start()

    # --- any thread ----------------------------------------------------------------------

    def post(self, message: tuple[str, TransferJob, object]) -> None:
        with self._post_lock:
            if self._closed:
                if message[0] == "begin":  # never reached the owner: fail it here
                    message[1].outcome.set_exception(self._closed_error())
                return  # a job posted to before: the owner failed it at close
            self._inbox.put(message)
        os.eventfd_write(self._wake, 1)

    def stats(self) -> TransferStats:
        return self._stats

    def _closed_error(self) -> TransferError:
        return TransferError(f"writer to region {self.handle.region_id} is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._post_lock:
            if self._closed:
                return
            self._closed = True
        os.eventfd_write(self._wake, 1)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(_CLOSE_TIMEOUT_S)

    def _retire(self) -> None:
        """Owner thread: the target is gone for good; take no more jobs. The loop exits
        after this round, failing what is left and releasing the mapping or socket."""
        with self._post_lock:
            self._closed = True

    # --- transport hooks (owner thread) ------------------------------------------------

    def _new_work(self, job: TransferJob) -> JobWork:
        return JobWork(job)

    def _start(self, work: JobWork) -> None:
        """A job begins: raise ``TransferError`` if its target is known to be gone."""

    @abstractmethod
    def _move(self) -> None:
        """Move what the started jobs have pending (``_moved`` for each layer run taken).
        May take messages in between (``_take_messages``) so an abort stops a long copy."""

    def _each_pending(self, step: Callable[[JobWork], None]) -> None:
        """``step(work)`` for every job with layers pending (the ``_move`` of writers that
        queue a job's bytes: tcp frames them, mooncake submits them); a ``TransferError``
        it raises fails that job alone."""
        for work in list(self._works.values()):
            if work.pending and not work.done:
                try:
                    step(work)
                except TransferError as exc:
                    self._fail(work, exc)

    def _copy_pending(self, copy: Callable[[JobWork, int, int], None]) -> None:
        """The ``_move`` of writers whose copy is the delivery (shm, cuda_ipc): every job's
        lowest run of pending layers in turn, through ``copy(work, start, stop)`` (which
        calls ``_moved``), after the fault spec had its say."""
        for work in list(self._works.values()):
            while work.pending and not work.done:
                start, stop = lowest_run(work.pending)
                try:
                    self._inject(work)
                except TransferError as exc:
                    self._fail(work, exc)
                    break
                copy(work, start, stop)

    @abstractmethod
    def _end(self, work: JobWork) -> None:
        """Every written layer of an ending job moved: confirm it (``_succeed``) now, or
        arrange for it before its deadline."""

    def _drop(self, work: JobWork) -> Drop:
        """``work`` failed: forget its queued bytes and say what is left in flight. The
        writers whose copy is the delivery stop on this thread: nothing is."""
        return Drop.QUIET

    def _give_up(self, work: JobWork) -> None:
        """``work`` drained for ``DRAIN_TIMEOUT_S`` without an answer: stop waiting for one
        (a transport closes what it waited on); it is then resolved as not quiet."""

    def _has_ready_bytes(self) -> bool:
        """Whether the transport could move bytes now, without waiting for anything."""
        return False

    def _release(self) -> None:
        """The owner is exiting: release the mapping or socket."""

    def _drop_connection(self, work: JobWork) -> None:
        """A fault spec drops ``work``'s connection (transports that have one)."""

    def _inject(self, work: JobWork) -> None:
        """The fault spec's say, right before a run of ``work``'s layers moves: delay, stall
        (once per job), drop the connection or fail the job (``InjectedFault``)."""
        dice = self.dice
        if dice is None:
            return
        if work.faults is None:
            work.faults = dice.job_fate()
        fail, stall, drop = work.faults
        work.faults = (False, False, False)  # each fires once per job
        dice.delay()
        if stall:
            dice.stall()  # a late write follows: an abort that came meanwhile is unseen
        if drop:
            self._drop_connection(work)
            raise InjectedFault(f"injected fault: connection of {work.job.request_id!r} dropped")
        if fail:
            raise InjectedFault(f"injected fault: transfer of {work.job.request_id!r} failed")

    # --- owner thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closed:
                self._take_messages()
                self._move()
                self._end_ready()
                self._expire(time.monotonic())
                for key, events in self._selector.select(self._sleep_for()):
                    key.data(events)
        except Exception as exc:  # a bug or an OS failure: fail every job, never hang
            log.exception("kv_writer_failed", region=self.handle.region_id)
            self._fail_all(
                TransferError(f"writer to region {self.handle.region_id} failed: {exc!r}")
            )
        finally:
            with self._post_lock:
                self._closed = True
            self._take_messages()  # begun before closing: failed below with the rest
            self._fail_all(self._closed_error())
            self._release()
            self._selector.close()

    def _on_wake(self, events: int) -> None:
        try:
            os.eventfd_read(self._wake)
        except BlockingIOError:
            pass

    def _sleep_for(self) -> float | None:
        """How long the loop may wait; every post wakes it."""
        return 0.0 if self._closed else self._next_wait()  # retired: exit at once

    def _next_wait(self) -> float | None:
        """0 with bytes to move now; else until the soonest deadline (None: none)."""
        if self._has_ready_bytes():
            return 0.0
        times = [w.job.deadline for w in self._works.values()]
        times.extend(self._draining.values())
        if not times:
            return None
        return max(0.0, min(times) - time.monotonic())

    def _take_messages(self) -> None:
        while True:
            try:
                kind, job, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "begin":
                self._on_begin(job)
                continue
            work = self._works.get(job.request_id)
            if work is None or work.job is not job:
                continue  # the job ended already; its outcome says how
            if kind == "layer":
                self._on_layer(work, arg)
            elif kind == "finish" and not work.ending:
                work.ending = True
                assert isinstance(arg, float)  # when finish() was called: what it posts
                work.finish_at = arg
            elif kind == "abort":
                self._fail(
                    work, TransferError(f"transfer of {job.request_id!r} {arg}"), aborted=True
                )

    def _on_begin(self, job: TransferJob) -> None:
        if job.request_id in self._works:
            job.outcome.set_exception(
                TransferError(f"request {job.request_id!r} already has a transfer in flight")
            )
            return
        work = self._new_work(job)
        try:
            self._start(work)
        except TransferError as exc:
            job.outcome.set_exception(exc)
            return
        self._works[job.request_id] = work

    def _on_layer(self, work: JobWork, arg: object) -> None:
        assert isinstance(arg, tuple)  # (layer, ready, when): what write_layer posts
        layer, ready, posted_at = arg
        try:
            check_layer(layer, work.job.blocks.num_layers)
        except TransferError as exc:
            self._fail(work, TransferError(f"{work.job.request_id!r}: {exc}"))
            return
        assert isinstance(layer, int)
        # A staged layer (GPU -> host on a side stream) is waited for here, before any of
        # its bytes are read: well under a millisecond, bounded by the job's deadline.
        if ready is not None and not ready(work.job.deadline):
            self._fail(work, self._timeout(work))
            return
        bit = 1 << layer
        if work.written & bit:
            self._fail(
                work, TransferError(f"layer {layer} of {work.job.request_id!r} written twice")
            )
            return
        if work.ending:
            self._fail(
                work, TransferError(f"layer {layer} of {work.job.request_id!r} after finish()")
            )
            return
        if work.first_write_at is None:
            work.first_write_at = time.monotonic()
        work.last_layer_at = max(work.last_layer_at, posted_at)
        work.written |= bit
        work.pending |= bit

    def _landed(self, work: JobWork, nbytes: int) -> None:
        """``nbytes`` more of ``work`` were delivered (transports call this as they go)."""
        work.bytes_moved += nbytes
        work.landings.append((time.monotonic(), work.bytes_moved))

    def _moved(self, work: JobWork, start: int, stop: int) -> None:
        """Layers ``[start, stop)`` of ``work`` left its pending set (transports count the
        bytes with ``_landed`` as they are delivered)."""
        work.pending &= ~((1 << stop) - (1 << start))

    def _end_ready(self) -> None:
        for work in list(self._works.values()):
            if work.ending and not work.pending and not work.ended and not work.done:
                work.ended = True
                try:
                    self._end(work)
                except TransferError as exc:
                    self._fail(work, exc)

    def _expire(self, now: float) -> None:
        for work in list(self._works.values()):
            if now > work.job.deadline and not work.done:
                self._fail(work, self._timeout(work))
        for work, give_up_at in list(self._draining.items()):
            if now > give_up_at:
                self._give_up(work)
                self._resolve(work, quiet=False)

    def _timeout(self, work: JobWork) -> TransferTimeout:
        written = work.written.bit_count()
        return TransferTimeout(
            f"transfer of {work.job.request_id!r} to region {self.handle.region_id} missed its "
            f"deadline: {work.bytes_moved} of {written * work.job.blocks.layer_bytes} bytes moved"
            + (", awaiting confirmation" if work.ended else "")
        )

    def _succeed(self, work: JobWork) -> None:
        if work.done:
            return
        now = time.monotonic()
        first = work.first_write_at if work.first_write_at is not None else now
        finish_at = work.finish_at if work.finish_at is not None else now
        self._forget(work)
        s = self._stats
        self._stats = TransferStats(
            s.bytes + work.bytes_moved, s.seconds + now - first, s.jobs + 1, s.failures
        )
        work.job.outcome.set_result(
            TransferResult(
                bytes=work.bytes_moved,
                seconds=now - first,
                layers=work.written.bit_count(),
                wait_seconds=now - finish_at,
                present_at_last_layer=max(
                    (moved for at, moved in work.landings if at <= work.last_layer_at),
                    default=0,
                ),
            )
        )

    def _fail(self, work: JobWork, error: TransferError, *, aborted: bool = False) -> None:
        if work.done:
            return
        work.error = error
        self._forget(work)
        if not aborted:
            s = self._stats
            self._stats = TransferStats(s.bytes, s.seconds, s.jobs, s.failures + 1)
        left = self._drop(work)
        if left is Drop.DRAINING:
            self._draining[work] = time.monotonic() + DRAIN_TIMEOUT_S
        else:
            self._resolve(work, quiet=left is Drop.QUIET)

    def _resolve(self, work: JobWork, *, quiet: bool) -> None:
        """A failed job's bytes stopped moving (``quiet``: and none can land any more):
        count them, and let its outcome resolve."""
        assert work.error is not None
        self._draining.pop(work, None)
        if work.job.outcome.done():
            return
        s = self._stats
        self._stats = TransferStats(s.bytes + work.bytes_moved, s.seconds, s.jobs, s.failures)
        work.job._quiet = quiet
        work.job.outcome.set_exception(work.error)

    def _forget(self, work: JobWork) -> None:
        if self._works.get(work.job.request_id) is work:
            del self._works[work.job.request_id]

    def _fail_all(self, error: TransferError) -> None:
        """Fail every job; at the owner's exit also give up the ones still draining."""
        for work in list(self._works.values()):
            self._fail(work, error)
        if self._closed:
            for work in list(self._draining):
                self._give_up(work)
                self._resolve(work, quiet=False)

    def _watch(self, fileobj: object, events: int, callback: Callable[[int], None]) -> None:
        """Have the loop call ``callback(events)`` when ``fileobj`` is ready."""
        try:
            self._selector.modify(fileobj, events, callback)  # type: ignore[arg-type]
        except KeyError:
            self._selector.register(fileobj, events, callback)  # type: ignore[arg-type]

    def _unwatch(self, fileobj: object) -> None:
        try:
            self._selector.unregister(fileobj)  # type: ignore[arg-type]
        except (KeyError, ValueError):
            pass

"""The single owner of the scheduler's in-memory state, fed through one bounded queue.

Lifecycle of a command: caller → ``submit`` (``put_nowait`` on the bounded command queue;
full → ``SchedulerOverloaded`` at once) → the state loop takes it → a synchronous handler
mutates the state and may enqueue Redis writes (never awaited) → the caller's future gets
the result. One coroutine runs every handler, so no state is ever shared and nothing is
locked; a handler never awaits, so each command is atomic.

State owned here: the worker registry (info, state, load, lease), reservations made since a
worker's last heartbeat, the prefix index (block hash → worker ids) and a short memo of
recent placements (``Place`` is idempotent per request id and attempt).

A ticker enqueues ``ExpireTick`` every ``tick_s``: workers whose last heartbeat is older than
the lease are dropped (placement already ignores them from the moment the lease lapses).

Redis only mirrors this state: when it may have lost it (restarted, or back after an outage),
``request_mirror`` queues ``Mirror``, which writes every worker key and prefix set again.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog

from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.model import (
    HeartbeatAnswer,
    HeartbeatReport,
    Lease,
    Outcome,
    Placement,
    PlaceRequest,
    PrefillMode,
    Rejection,
    Reservation,
    Role,
    Routing,
    WorkerInfo,
    WorkerLoad,
    WorkerState,
    WorkerView,
)
from services.scheduler.policy import AdmissionLimits, ClusterSnapshot, place
from services.scheduler.store import NullSink, RecordSink, StoredWorker
from services.scheduler.store_index import StoreIndex

log = structlog.get_logger(__name__)


class SchedulerOverloaded(Exception):
    """The command queue is full: the caller should back off (RESOURCE_EXHAUSTED)."""


class SchedulerClosed(Exception):
    """The state loop is not running (starting or shut down): UNAVAILABLE."""


class UnknownWorker(Exception):
    """No registered worker has this id (its lease lapsed or it never registered)."""


# ---- commands ----


@dataclass(frozen=True)
class Register:
    info: WorkerInfo


@dataclass(frozen=True)
class Heartbeat:
    report: HeartbeatReport


@dataclass(frozen=True)
class Deregister:
    worker_id: str


@dataclass(frozen=True)
class Place:
    request: PlaceRequest


@dataclass(frozen=True)
class ReportOutcome:
    outcome: Outcome


@dataclass(frozen=True)
class ExpireTick:
    pass


@dataclass(frozen=True)
class Inspect:
    """Read-only: a copy of the current snapshot (tests, debugging)."""


@dataclass(frozen=True)
class Mirror:
    """Write the whole registry and prefix index to the sink again (Redis lost them)."""


Command = Register | Heartbeat | Deregister | Place | ReportOutcome | ExpireTick | Inspect | Mirror


@dataclass
class _Worker:
    """One registered worker; mutable, touched only by the state loop."""

    info: WorkerInfo
    state: WorkerState
    load: WorkerLoad
    last_seen: float
    registered_unix_ns: int
    cached: set[int] = field(default_factory=set)
    last_sequence: int | None = None
    needs_resync: bool = False
    reservations: dict[str, tuple[float, Reservation]] = field(default_factory=dict)
    confirmed: bool = True
    """False for a worker restored from Redis: a hint, not a peer, until it registers
    again (over an authenticated call); placement never sees it."""

    def view(self) -> WorkerView:
        blocks = seqs = tokens = 0
        for _, r in self.reservations.values():
            blocks += r.kv_blocks
            seqs += r.sequences
            tokens += r.prompt_tokens
        return WorkerView(
            info=self.info,
            state=self.state,
            load=self.load,
            last_seen=self.last_seen,
            pending_kv_blocks=blocks,
            pending_sequences=seqs,
            pending_prompt_tokens=tokens,
        )


@dataclass(frozen=True)
class StateConfig:
    """What the state loop needs to know; built from ``SchedulerConfig``."""

    lease_ttl_s: float
    heartbeat_interval_ms: int
    queue_size: int
    limits: AdmissionLimits = field(default_factory=AdmissionLimits)
    routing: Routing = Routing.CACHE_AWARE
    placement_memo_s: float = 60.0
    placement_memo_max: int = 100_000
    tick_s: float | None = None
    """Expiry tick period; default: a tenth of the lease, within [0.05, 1] s."""

    @property
    def expire_tick_s(self) -> float:
        if self.tick_s is not None:
            return self.tick_s
        return min(1.0, max(0.05, self.lease_ttl_s / 10))


class SchedulerState:
    """The state loop and its typed, awaitable front door (``register``, ``place``, ...).

    ``restore`` (optional) seeds the state from Redis before ``start``; after ``start`` every
    method goes through the queue. Methods raise ``SchedulerOverloaded`` when the queue is
    full and ``SchedulerClosed`` when the loop is not running.
    """

    def __init__(
        self,
        config: StateConfig,
        *,
        sink: RecordSink | None = None,
        metrics: SchedulerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._sink: RecordSink = sink or NullSink()
        self._metrics = metrics
        self._clock = clock
        self._queue: asyncio.Queue[tuple[Command, asyncio.Future[Any] | None]] = asyncio.Queue(
            maxsize=config.queue_size
        )
        self._workers: dict[str, _Worker] = {}
        self._index: dict[int, set[str]] = {}
        self._stored = StoreIndex()
        self._memo: OrderedDict[tuple[str, int], tuple[float, Placement]] = OrderedDict()
        self._last_prefill = ""  # the previous placement's workers (round-robin)
        self._last_decode = ""
        self._tasks: list[asyncio.Task[None]] = []
        self._running = False
        self._settle_s = config.heartbeat_interval_ms / 2000.0

    # ---- lifecycle ----

    def restore(self, workers: Iterable[StoredWorker], prefix_index: dict[int, set[str]]) -> None:
        """Seed the registry and prefix index (scheduler restart). Call before ``start``.

        Redis is not trusted with who the peers are: whoever can write to it could name an
        address of theirs, and placing a request there would hand it a placement token and
        the gateway's cluster token. So a restored worker is a hint: nothing is placed on it
        and its heartbeats answer NOT_FOUND until it registers again (which it does at
        once); one that does not is dropped one lease after this start.
        """
        if self._running:
            raise RuntimeError("restore() must run before start()")
        now = self._clock()
        for stored in workers:
            self._workers[stored.info.worker_id] = _Worker(
                info=stored.info,
                state=stored.state,
                load=stored.load,
                last_seen=now,
                registered_unix_ns=stored.registered_unix_ns,
                needs_resync=True,
                confirmed=False,
            )
        for block_hash, holders in prefix_index.items():
            known = {w for w in holders if w in self._workers}
            if known:
                self._index[block_hash] = known
                for worker_id in known:
                    self._workers[worker_id].cached.add(block_hash)
        self._update_worker_gauges()

    def start(self) -> None:
        """Start the state loop and the expiry ticker on the running event loop."""
        if self._running:
            return
        self._running = True
        self._tasks = [
            asyncio.create_task(self._run(), name="scheduler-state"),
            asyncio.create_task(self._tick(), name="scheduler-expiry"),
        ]

    async def stop(self) -> None:
        """Stop the loop; commands still queued fail with ``SchedulerClosed``."""
        self._running = False
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks = []
        while not self._queue.empty():
            _, fut = self._queue.get_nowait()
            if fut is not None and not fut.done():
                fut.set_exception(SchedulerClosed("scheduler stopped"))

    @property
    def queue_depth(self) -> int:
        """Commands waiting for the loop."""
        return self._queue.qsize()

    @property
    def lease(self) -> Lease:
        """The lease terms handed to registering workers."""
        return Lease(
            heartbeat_interval_ms=self._config.heartbeat_interval_ms,
            lease_ttl_ms=int(self._config.lease_ttl_s * 1000),
        )

    # ---- the front door ----

    async def submit(self, command: Command) -> Any:
        """Queue ``command`` and await its result (or its exception)."""
        if not self._running:
            raise SchedulerClosed("scheduler is not running")
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        try:
            self._queue.put_nowait((command, fut))
        except asyncio.QueueFull:
            raise SchedulerOverloaded(
                f"scheduler queue full ({self._config.queue_size} commands)"
            ) from None
        return await fut

    async def register(self, info: WorkerInfo) -> Lease:
        return await self.submit(Register(info))

    async def heartbeat(self, report: HeartbeatReport) -> HeartbeatAnswer:
        return await self.submit(Heartbeat(report))

    async def deregister(self, worker_id: str) -> None:
        await self.submit(Deregister(worker_id))

    async def place(self, request: PlaceRequest) -> Placement | Rejection:
        return await self.submit(Place(request))

    async def report_outcome(self, outcome: Outcome) -> None:
        await self.submit(ReportOutcome(outcome))

    async def inspect(self) -> ClusterSnapshot:
        """A copy of the state as placement would see it now."""
        return await self.submit(Inspect())

    def request_mirror(self) -> bool:
        """Queue a ``Mirror`` without waiting for it; False when the loop is not running or
        its queue is full (ask again later)."""
        if not self._running:
            return False
        try:
            self._queue.put_nowait((Mirror(), None))
        except asyncio.QueueFull:
            return False
        return True

    # ---- the loop ----

    async def _run(self) -> None:
        while True:
            command, fut = await self._queue.get()
            if fut is not None and fut.done():
                continue  # the caller gave up (deadline, cancel): don't do the work
            try:
                result = self._handle(command)
            except Exception as exc:
                if fut is not None and not fut.done():
                    fut.set_exception(exc)
                elif not isinstance(exc, UnknownWorker):
                    log.exception("state_command_failed", command=type(command).__name__)
                continue
            if fut is not None and not fut.done():
                fut.set_result(result)

    async def _tick(self) -> None:
        period = self._config.expire_tick_s
        while True:
            await asyncio.sleep(period)
            try:
                self._queue.put_nowait((ExpireTick(), None))
            except asyncio.QueueFull:
                pass  # the loop is busy; placement ignores dead workers anyway

    def _handle(self, command: Command) -> Any:
        match command:
            case Place(request):
                return self._place(request)
            case Heartbeat(report):
                return self._heartbeat(report)
            case Register(info):
                return self._register(info)
            case Deregister(worker_id):
                self._remove(worker_id, reason="deregistered")
                return None
            case ReportOutcome(outcome):
                return self._outcome(outcome)
            case ExpireTick():
                return self._expire()
            case Inspect():
                return self._snapshot(copy_index=True)
            case Mirror():
                return self._mirror()
        raise TypeError(f"unknown command {command!r}")

    # ---- handlers (synchronous: each runs to completion without yielding) ----

    def _snapshot(self, copy_index: bool = False) -> ClusterSnapshot:
        index: dict[int, set[str]] | dict[int, frozenset[str]] = self._index
        if copy_index:
            index = {h: frozenset(ws) for h, ws in self._index.items()}
        return ClusterSnapshot(
            workers=tuple(w.view() for w in self._workers.values() if w.confirmed),
            prefix_index=index,
            now=self._clock(),
            lease_ttl_s=self._config.lease_ttl_s,
            limits=self._config.limits,
            routing=self._config.routing,
            store_index=self._stored,
            last_prefill=self._last_prefill,
            last_decode=self._last_decode,
        )

    def _register(self, info: WorkerInfo) -> Lease:
        if info.worker_id in self._workers:
            self._remove(info.worker_id, reason="re-registered", delete_key=False)
        self._check_block_size(info)
        cap = info.capacity
        worker = _Worker(
            info=info,
            state=WorkerState.REGISTERED,
            load=WorkerLoad(
                free_kv_blocks=cap.total_kv_blocks, total_kv_blocks=cap.total_kv_blocks
            ),
            last_seen=self._clock(),
            registered_unix_ns=time.time_ns(),
        )
        self._workers[info.worker_id] = worker
        self._sink.put_worker(info, worker.state, worker.load, worker.registered_unix_ns)
        self._update_worker_gauges()
        log.info("worker_registered", worker_id=info.worker_id, role=info.role.value)
        return self.lease

    def _check_block_size(self, info: WorkerInfo) -> None:
        """Log a worker whose block size differs from its model's other workers': prefix
        hashes are cut in one size, so prefix routing cannot reach both."""
        size = info.capacity.block_size
        others = {
            w.info.capacity.block_size for w in self._workers.values() if w.info.model == info.model
        }
        if others - {size}:
            log.warning(
                "block_size_mismatch",
                worker_id=info.worker_id,
                model=info.model,
                block_size=size,
                other_block_sizes=sorted(others - {size}),
            )

    def _heartbeat(self, report: HeartbeatReport) -> HeartbeatAnswer:
        worker = self._workers.get(report.worker_id)
        now = self._clock()
        if worker is None or now - worker.last_seen > self._config.lease_ttl_s:
            # A lapsed lease is final even if the expiry tick has not run yet: the worker's
            # requests may already be re-placed, so it must register afresh.
            if worker is not None:
                self._lapse(report.worker_id)
            raise UnknownWorker(f"unknown worker_id {report.worker_id!r}")
        if not worker.confirmed:
            raise UnknownWorker(f"worker {report.worker_id!r} must register again")
        worker.last_seen = now
        worker.state = report.state
        worker.load = report.load
        if report.cache_snapshot:
            if self._metrics:
                self._metrics.kv_events.labels("snapshot").inc()
            new = set(report.cached_added)
            self._update_cache(worker, added=new - worker.cached, removed=worker.cached - new)
            worker.needs_resync = False
        else:
            if worker.last_sequence is not None and report.sequence != worker.last_sequence + 1:
                worker.needs_resync = True
            self._update_cache(
                worker, added=set(report.cached_added), removed=set(report.cached_removed)
            )
        worker.last_sequence = report.sequence
        self._stored.note(worker.info.kv_store, report.stored)
        self._stored.forget(worker.info.kv_store, report.store_missing)
        # The reported load includes requests placed well before this heartbeat; newer
        # reservations may not have reached the worker yet, so they stay counted.
        settled = now - self._settle_s
        worker.reservations = {
            rid: (at, r) for rid, (at, r) in worker.reservations.items() if at > settled
        }
        self._sink.put_worker(worker.info, worker.state, worker.load, worker.registered_unix_ns)
        return HeartbeatAnswer(
            resync_cache=worker.needs_resync,
            heartbeat_interval_ms=self._config.heartbeat_interval_ms,
        )

    def _update_cache(self, worker: _Worker, added: set[int], removed: set[int]) -> None:
        worker_id = worker.info.worker_id
        removed &= worker.cached
        added -= worker.cached
        for block_hash in removed:
            holders = self._index.get(block_hash)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self._index[block_hash]
        for block_hash in added:
            self._index.setdefault(block_hash, set()).add(worker_id)
        worker.cached -= removed
        worker.cached |= added
        self._sink.update_prefixes(worker_id, added, removed)
        if self._metrics:
            self._metrics.kv_events.labels("added").inc(len(added))
            self._metrics.kv_events.labels("removed").inc(len(removed))
            self._metrics.prefix_blocks.set(len(self._index))

    def _place(self, request: PlaceRequest) -> Placement | Rejection:
        key = (request.request_id, request.attempt)
        memo = self._memo.get(key)
        if memo is not None:
            return memo[1]
        result = place(self._snapshot(), request)
        if isinstance(result, Rejection):
            if self._metrics:
                self._metrics.rejections.labels(result.reason.value).inc()
            return result
        now = self._clock()
        tokens = request.prompt_tokens - result.expected_cached_tokens  # to compute
        remote = result.mode is PrefillMode.DISAGGREGATED
        decode = self._workers[result.decode.worker_id]
        decode.reservations[request.request_id] = (
            now,
            Reservation(
                kv_blocks=result.decode_kv_blocks,
                sequences=1,
                prompt_tokens=0 if remote else tokens,
            ),
        )
        self._last_decode = decode.info.worker_id
        if remote and result.prefill is not None:
            prefill = self._workers[result.prefill.worker_id]
            prefill.reservations[request.request_id] = (
                now,
                Reservation(sequences=1, prompt_tokens=tokens),
            )
            self._last_prefill = prefill.info.worker_id
        self._memo[key] = (now, result)
        if len(self._memo) > self._config.placement_memo_max:
            self._memo.popitem(last=False)
        self._sink.record_placement(request, result)
        if self._metrics:
            self._metrics.placements.labels(result.mode.value).inc()
            self._metrics.cache_hit_tokens.inc(result.expected_cached_tokens)
        return result

    def _outcome(self, outcome: Outcome) -> None:
        for worker_id in (outcome.prefill_worker_id, outcome.decode_worker_id):
            worker = self._workers.get(worker_id)
            if worker is not None:
                worker.reservations.pop(outcome.request_id, None)
        self._sink.record_outcome(outcome)

    def _expire(self) -> list[str]:
        now = self._clock()
        ttl = self._config.lease_ttl_s
        dead = [wid for wid, w in self._workers.items() if now - w.last_seen > ttl]
        for worker_id in dead:
            self._lapse(worker_id)
        horizon = now - self._config.placement_memo_s
        while self._memo:
            _, (placed_at, _) = next(iter(self._memo.items()))
            if placed_at > horizon:
                break
            self._memo.popitem(last=False)
        return dead

    def _lapse(self, worker_id: str) -> None:
        """Drop a worker whose lease lapsed, counted whichever finds it first: the expiry
        tick or the worker's own late heartbeat."""
        self._remove(worker_id, reason="lease lapsed")
        if self._metrics:
            self._metrics.expired_workers.inc()

    def _mirror(self) -> int:
        for worker in self._workers.values():
            info = worker.info
            self._sink.put_worker(info, worker.state, worker.load, worker.registered_unix_ns)
            self._sink.update_prefixes(info.worker_id, set(worker.cached), ())
        log.info("redis_remirrored", workers=len(self._workers), prefixes=len(self._index))
        if self._metrics:
            self._metrics.redis_remirrors.inc()
        return len(self._workers)

    def _remove(self, worker_id: str, *, reason: str, delete_key: bool = True) -> None:
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return
        for block_hash in worker.cached:
            holders = self._index.get(block_hash)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self._index[block_hash]
        if self._metrics:
            self._metrics.prefix_blocks.set(len(self._index))
        if delete_key:
            self._sink.delete_worker(worker_id, worker.cached)
        else:
            self._sink.update_prefixes(worker_id, (), worker.cached)
        self._update_worker_gauges()
        log.info("worker_removed", worker_id=worker_id, reason=reason)

    def _update_worker_gauges(self) -> None:
        if self._metrics is None:
            return
        counts: dict[Role, int] = {}
        for w in self._workers.values():
            counts[w.info.role] = counts.get(w.info.role, 0) + 1
        self._metrics.set_workers(counts)

"""The state loop: bounded queue, lease expiry, reservations, prefix index, idempotency."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import replace

import pytest
from structlog.testing import capture_logs

from services.scheduler.model import (
    FinishReason,
    HeartbeatReport,
    Outcome,
    Placement,
    PrefillMode,
    Rejection,
    RejectReason,
    Role,
    WorkerInfo,
    WorkerLoad,
    WorkerState,
)
from services.scheduler.policy import AdmissionLimits
from services.scheduler.state import (
    SchedulerClosed,
    SchedulerOverloaded,
    SchedulerState,
    StateConfig,
    UnknownWorker,
)
from services.scheduler.store import NullSink, StoredWorker
from tests.services.scheduler.builders import BLOCK, capacity, info, request

TTL_S = 0.5


def _load(free: int = 1000, running: int = 0, queued: int = 0) -> WorkerLoad:
    return WorkerLoad(
        running_requests=running,
        free_kv_blocks=free,
        total_kv_blocks=1000,
        queued_prompt_tokens=queued,
    )


def _beat(
    worker_id: str,
    sequence: int,
    *,
    load: WorkerLoad | None = None,
    added: tuple[int, ...] = (),
    removed: tuple[int, ...] = (),
    snapshot: bool = False,
    state: WorkerState = WorkerState.SERVING,
) -> HeartbeatReport:
    return HeartbeatReport(
        worker_id=worker_id,
        state=state,
        sequence=sequence,
        load=load or _load(),
        cached_added=added,
        cached_removed=removed,
        cache_snapshot=snapshot,
    )


def _config(queue_size: int = 64, tick_s: float | None = 0.02, **limits: int) -> StateConfig:
    return StateConfig(
        lease_ttl_s=TTL_S,
        heartbeat_interval_ms=100,
        queue_size=queue_size,
        limits=AdmissionLimits(**limits),
        tick_s=tick_s,
    )


@pytest.fixture
async def state() -> AsyncIterator[SchedulerState]:
    s = SchedulerState(_config())
    s.start()
    yield s
    await s.stop()


async def _join(s: SchedulerState, worker_id: str, role: Role, **load: int) -> None:
    lease = await s.register(info(worker_id, role))
    assert lease.lease_ttl_ms == int(TTL_S * 1000)
    answer = await s.heartbeat(_beat(worker_id, 0, load=_load(**load), snapshot=True))
    assert not answer.resync_cache


async def test_full_queue_rejects_at_once_and_recovers() -> None:
    s = SchedulerState(_config(queue_size=3, tick_s=100.0))
    s.start()
    try:
        await _join(s, "d1", Role.DECODE)
        # All 10 calls enqueue before the loop runs again: 3 fit, 7 are refused.
        results = await asyncio.gather(
            *(s.place(request(f"r{i}")) for i in range(10)), return_exceptions=True
        )
        refused = [r for r in results if isinstance(r, SchedulerOverloaded)]
        placed = [r for r in results if isinstance(r, Placement)]
        assert (len(placed), len(refused)) == (3, 7)
        assert s.queue_depth == 0
        assert isinstance(await s.place(request("after")), Placement)
    finally:
        await s.stop()
    with pytest.raises(SchedulerClosed):
        await s.place(request("closed"))


async def test_worker_expires_after_its_lease(state: SchedulerState) -> None:
    await _join(state, "d1", Role.DECODE)
    await _join(state, "d2", Role.DECODE, running=3)
    assert (await state.place(request("r0"))).decode.worker_id == "d1"

    seq = 0
    silent_since = time.monotonic()
    dropped_after = None
    deadline = silent_since + 3 * TTL_S
    while time.monotonic() < deadline:  # d2 heartbeats, d1 has gone silent
        seq += 1
        await state.heartbeat(_beat("d2", seq, load=_load(running=3)))
        ids = {w.worker_id for w in (await state.inspect()).workers}
        if "d1" not in ids:
            dropped_after = time.monotonic() - silent_since
            break
        await asyncio.sleep(0.05)
    assert dropped_after is not None, "d1 was never dropped"
    # The lease is 0.5 s; the expiry tick runs every 0.02 s, the poll every 0.05 s.
    assert TTL_S - 0.05 <= dropped_after <= TTL_S + 0.3
    for i in range(5):
        placed = await state.place(request(f"r{i + 1}"))
        assert isinstance(placed, Placement) and placed.decode.worker_id == "d2"
    with pytest.raises(UnknownWorker):
        await state.heartbeat(_beat("d1", 1))


async def test_lapsed_heartbeat_is_refused_even_before_the_tick() -> None:
    from services.scheduler.metrics import SchedulerMetrics

    metrics = SchedulerMetrics()
    s = SchedulerState(_config(tick_s=100.0), metrics=metrics)
    s.start()
    try:
        await _join(s, "d1", Role.DECODE)
        await asyncio.sleep(TTL_S + 0.05)
        # No tick ran yet, but placement ignores the dead worker and its heartbeat fails.
        rejection = await s.place(request())
        assert isinstance(rejection, Rejection)
        assert rejection.reason is RejectReason.NO_LIVE_WORKER
        with pytest.raises(UnknownWorker):
            await s.heartbeat(_beat("d1", 1))
        assert (await s.inspect()).workers == ()
        # dropped by its heartbeat, not the tick: a lapse all the same
        assert metrics.registry.get_sample_value("pdserve_scheduler_expired_workers_total") == 1
    finally:
        await s.stop()


async def test_registered_worker_waits_for_its_first_heartbeat(state: SchedulerState) -> None:
    await state.register(info("d1", Role.DECODE))
    assert isinstance(await state.place(request("r1")), Rejection)
    await state.heartbeat(_beat("d1", 0, snapshot=True))
    assert isinstance(await state.place(request("r2")), Placement)


async def test_reservations_spread_back_to_back_placements(state: SchedulerState) -> None:
    await _join(state, "d1", Role.DECODE)
    await _join(state, "d2", Role.DECODE)
    await _join(state, "p1", Role.PREFILL)
    await _join(state, "p2", Role.PREFILL)
    first = await state.place(request("r1", prompt=200))
    second = await state.place(request("r2", prompt=200))
    assert isinstance(first, Placement) and isinstance(second, Placement)
    assert {first.decode.worker_id, second.decode.worker_id} == {"d1", "d2"}
    assert first.prefill and second.prefill
    assert {first.prefill.worker_id, second.prefill.worker_id} == {"p1", "p2"}
    views = {w.worker_id: w for w in (await state.inspect()).workers}
    blocks = -(-(200 + 28) // BLOCK)
    assert views[first.decode.worker_id].pending_kv_blocks == blocks
    assert views[first.prefill.worker_id].pending_prompt_tokens == 200
    # The outcome releases the reservation at once.
    await state.report_outcome(
        Outcome(
            request_id="r1",
            finish_reason=FinishReason.STOP,
            prefill_worker_id=first.prefill.worker_id,
            decode_worker_id=first.decode.worker_id,
        )
    )
    views = {w.worker_id: w for w in (await state.inspect()).workers}
    assert views[first.decode.worker_id].pending_sequences == 0
    assert views[first.prefill.worker_id].pending_prompt_tokens == 0
    assert views[second.decode.worker_id].pending_sequences == 1
    # A heartbeat well after the placement carries the load itself: the reservation goes.
    await asyncio.sleep(0.1)
    await state.heartbeat(_beat(second.decode.worker_id, 1, load=_load(running=1)))
    views = {w.worker_id: w for w in (await state.inspect()).workers}
    assert views[second.decode.worker_id].pending_sequences == 0
    assert views[second.decode.worker_id].active_sequences == 1


async def test_place_is_idempotent_per_request_and_attempt(state: SchedulerState) -> None:
    await _join(state, "d1", Role.DECODE)
    await _join(state, "d2", Role.DECODE)
    first = await state.place(request("r1"))
    again = await state.place(request("r1"))
    assert again == first
    assert isinstance(first, Placement)
    retry = await state.place(request("r1", attempt=1, exclude=frozenset({first.decode.worker_id})))
    assert isinstance(retry, Placement) and retry.decode.worker_id != first.decode.worker_id


async def test_prefix_index_follows_heartbeats(state: SchedulerState) -> None:
    await _join(state, "d1", Role.DECODE)
    await _join(state, "p1", Role.PREFILL)
    await state.register(info("p2", Role.PREFILL))
    await state.heartbeat(_beat("p2", 0, added=(1, 2, 3), snapshot=True))
    placed = await state.place(request("r1", hashes=(1, 2, 3, 4)))
    assert isinstance(placed, Placement) and placed.prefill and placed.prefill.worker_id == "p2"
    assert placed.expected_cached_tokens == 3 * BLOCK
    # p2 evicts block 1; p1 caches 1 and 2: p1 now holds the longest leading run.
    await state.heartbeat(_beat("p2", 1, removed=(1,)))
    await state.heartbeat(_beat("p1", 1, added=(1, 2)))
    placed = await state.place(request("r2", hashes=(1, 2, 3, 4)))
    assert isinstance(placed, Placement) and placed.prefill and placed.prefill.worker_id == "p1"
    assert placed.expected_cached_tokens == 2 * BLOCK
    index = (await state.inspect()).prefix_index
    assert dict(index) == {1: {"p1"}, 2: {"p1", "p2"}, 3: {"p2"}}
    # A snapshot replaces what was known; deregistering forgets the worker's blocks.
    await state.heartbeat(_beat("p2", 2, added=(9,), snapshot=True))
    await state.deregister("p1")
    assert dict((await state.inspect()).prefix_index) == {9: {"p2"}}


async def test_the_store_index_follows_confirmations_and_reported_misses(
    state: SchedulerState,
) -> None:
    for worker_id, role in (("d1", Role.DECODE), ("p1", Role.PREFILL)):
        await state.register(info(worker_id, role, kv_store="kv:1"))
        await state.heartbeat(_beat(worker_id, 0, snapshot=True))
    # p1 put 4 blocks of a 5-block prompt: d1 would load them and compute 16 tokens
    await state.heartbeat(replace(_beat("p1", 1), stored=(1, 2, 3, 4)))
    prompt = request("r1", prompt=5 * BLOCK, hashes=(1, 2, 3, 4))
    placed = await state.place(prompt)
    assert isinstance(placed, Placement) and placed.mode is PrefillMode.LOCAL_SHORT_PROMPT
    assert placed.expected_cached_tokens == 4 * BLOCK
    # d1's lookup found block 2 gone (evicted): only block 1 is cheap now; p1 computes
    await state.heartbeat(replace(_beat("d1", 1), store_missing=(2,)))
    placed = await state.place(replace(prompt, request_id="r2"))
    assert isinstance(placed, Placement) and placed.mode is PrefillMode.DISAGGREGATED
    assert placed.expected_cached_tokens == BLOCK


async def test_sequence_gap_asks_for_a_cache_snapshot(state: SchedulerState) -> None:
    await _join(state, "p1", Role.PREFILL)
    assert not (await state.heartbeat(_beat("p1", 1))).resync_cache
    assert (await state.heartbeat(_beat("p1", 3, added=(5,)))).resync_cache  # 2 was lost
    assert (await state.heartbeat(_beat("p1", 4))).resync_cache  # until a snapshot comes
    assert not (await state.heartbeat(_beat("p1", 5, added=(5, 6), snapshot=True))).resync_cache


async def test_draining_worker_gets_no_new_placements(state: SchedulerState) -> None:
    await _join(state, "d1", Role.DECODE)
    await _join(state, "d2", Role.DECODE, running=5)
    await state.heartbeat(_beat("d1", 1, state=WorkerState.DRAINING))
    placed = await state.place(request("r1"))
    assert isinstance(placed, Placement) and placed.decode.worker_id == "d2"


async def test_reregistering_replaces_the_record(state: SchedulerState) -> None:
    await _join(state, "p1", Role.PREFILL)
    await state.heartbeat(_beat("p1", 1, added=(7,)))
    await state.register(info("p1", Role.PREFILL))
    snap = await state.inspect()
    assert [w.state for w in snap.workers] == [WorkerState.REGISTERED]
    assert dict(snap.prefix_index) == {}


async def test_a_restored_worker_is_a_hint_until_it_registers_again() -> None:
    """Redis is not a trust root: a worker restored from it (its address could be anyone's)
    gets no placement and its heartbeats answer NOT_FOUND until it registers again; one
    that never does is dropped a lease after the start."""
    now = [1000.0]
    s = SchedulerState(_config(), clock=lambda: now[0])
    stored = [
        StoredWorker(
            info=info(worker_id, role),
            state=WorkerState.SERVING,
            load=_load(),
            registered_unix_ns=1,
        )
        for worker_id, role in (("d1", Role.DECODE), ("p1", Role.PREFILL))
    ]
    s.restore(stored, {1: {"p1", "gone"}, 2: {"gone"}})
    s.start()
    try:
        rejection = await s.place(request("r1", hashes=(1,)))
        assert isinstance(rejection, Rejection), rejection
        assert rejection.reason is RejectReason.NO_LIVE_WORKER
        with pytest.raises(UnknownWorker, match="must register again"):
            await s.heartbeat(_beat("d1", 7))
        await s.register(info("d1", Role.DECODE))  # what a worker does on NOT_FOUND
        assert (await s.heartbeat(_beat("d1", 0))).resync_cache is False
        placed = await s.place(request("r2", hashes=(1,)))
        assert isinstance(placed, Placement) and placed.decode.worker_id == "d1"
        assert placed.prefill is None or placed.prefill.worker_id != "p1"  # still a hint
        for seq in (1, 2):  # d1 keeps its lease; p1 never registered: dropped with its blocks
            now[0] += TTL_S * 0.6
            await s.heartbeat(_beat("d1", seq))
        await asyncio.sleep(0.2)  # the expiry tick (every 20 ms)
        snap = await s.inspect()
        assert [w.info.worker_id for w in snap.workers] == ["d1"] and not snap.prefix_index
    finally:
        await s.stop()


async def test_capacity_rejection_carries_a_retry_hint(state: SchedulerState) -> None:
    await _join(state, "d1", Role.DECODE, free=4)
    rejection = await state.place(request(prompt=100, max_tokens=100))
    assert isinstance(rejection, Rejection)
    assert rejection.reason is RejectReason.CAPACITY and rejection.retry_after_ms > 0


class _RecordingSink(NullSink):
    """Remembers which workers and prefix sets were written."""

    def __init__(self) -> None:
        self.workers: list[str] = []
        self.prefixes: dict[str, set[int]] = {}

    def put_worker(
        self, info: WorkerInfo, state: WorkerState, load: WorkerLoad, registered_unix_ns: int
    ) -> None:
        self.workers.append(info.worker_id)

    def update_prefixes(self, worker_id: str, added: Iterable[int], removed: Iterable[int]) -> None:
        self.prefixes.setdefault(worker_id, set()).update(added)


async def test_mirror_writes_every_worker_and_prefix_set_again() -> None:
    sink = _RecordingSink()
    s = SchedulerState(_config(), sink=sink)
    s.start()
    try:
        await _join(s, "d1", Role.DECODE)
        await s.register(info("p1", Role.PREFILL))
        await s.heartbeat(_beat("p1", 0, added=(1, 2), snapshot=True))
        await s.heartbeat(_beat("p1", 1, removed=(1,)))
        sink.workers.clear()
        sink.prefixes.clear()
        assert s.request_mirror()
        await s.inspect()  # queued behind the mirror: it has run
        assert sorted(sink.workers) == ["d1", "p1"]
        assert sink.prefixes == {"d1": set(), "p1": {2}}
    finally:
        await s.stop()
    assert not s.request_mirror()  # no loop: the caller asks again later


async def test_a_mirror_that_does_not_fit_the_queue_is_refused_at_once() -> None:
    s = SchedulerState(_config(queue_size=1, tick_s=60))
    s.start()
    try:
        assert s.request_mirror()
        assert not s.request_mirror()
    finally:
        await s.stop()


async def test_kv_event_metrics_count_what_changed_the_index() -> None:
    from services.scheduler.metrics import SchedulerMetrics

    metrics = SchedulerMetrics()
    s = SchedulerState(_config(), metrics=metrics)
    s.start()
    try:

        def value(name: str, **labels: str) -> float:
            got = metrics.registry.get_sample_value(name, labels)
            return 0.0 if got is None else got

        await _join(s, "d1", Role.DECODE)
        await s.register(info("p1", Role.PREFILL))
        await s.heartbeat(_beat("p1", 0, added=(1, 2, 3), snapshot=True))
        await s.heartbeat(_beat("p1", 1, added=(3, 4), removed=(1, 7)))  # 3 known, 7 unknown
        assert value("pdserve_scheduler_kv_events_total", kind="added") == 4
        assert value("pdserve_scheduler_kv_events_total", kind="removed") == 1
        assert value("pdserve_scheduler_kv_events_total", kind="snapshot") == 2  # d1's, p1's
        assert value("pdserve_scheduler_prefix_index_blocks") == 3
        await s.place(request("r1", prompt=100, hashes=(5, 2, 3)))
        assert value("pdserve_scheduler_expected_cached_tokens_total") == 0  # 5 is not cached
        await s.heartbeat(_beat("p1", 2, added=(1,)))
        await s.place(request("r2", prompt=100, hashes=(1, 2, 3)))
        assert value("pdserve_scheduler_expected_cached_tokens_total") == 3 * BLOCK
        await s.deregister("p1")
        assert value("pdserve_scheduler_prefix_index_blocks") == 0
    finally:
        await s.stop()


async def test_a_worker_of_another_block_size_is_logged(state: SchedulerState) -> None:
    """Prefix hashes are cut in one block size: workers of one model with two sizes cannot
    all be routed by prefix, which must show, not pass silently."""
    with capture_logs() as logs:
        await state.register(info("p1", Role.PREFILL))
        await state.register(info("p2", Role.PREFILL, model="other", cap=capacity(block_size=32)))
        await state.register(info("d1", Role.DECODE, cap=capacity(block_size=2 * BLOCK)))
    [warning] = [e for e in logs if e["event"] == "block_size_mismatch"]
    assert warning["worker_id"] == "d1" and warning["other_block_sizes"] == [BLOCK]

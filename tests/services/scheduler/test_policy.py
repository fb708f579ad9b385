"""Placement policy: pure function tests (no loop, no Redis, no gRPC)."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.model import (
    Placement,
    PlaceRequest,
    PrefillMode,
    Rejection,
    RejectReason,
    Role,
    Routing,
    WorkerState,
    WorkerView,
    blocks_for,
)
from services.scheduler.policy import (
    LOCAL_PREFILL_MAX_TOKENS,
    AdmissionLimits,
    ClusterSnapshot,
    has_decode_room,
    has_prefill_room,
    is_live,
    place,
    prefix_overlaps,
)
from services.scheduler.store_index import StoreIndex
from tests.services.scheduler.builders import (
    BLOCK,
    NOW,
    TTL,
    capacity,
    request,
    snapshot,
    view,
)

H = (11, 22, 33, 44)  # a prompt's chained block hashes, first block first


def _placed(result: Placement | Rejection) -> Placement:
    assert isinstance(result, Placement), result
    return result


def _rejected(result: Placement | Rejection) -> Rejection:
    assert isinstance(result, Rejection), result
    return result


# ---- prefill choice ----


def test_cache_aware_prefill_cost_is_uncached_tokens_plus_backlog() -> None:
    # p2 caches 3 of the prompt's 5 blocks: it computes 80 - 48 = 32 tokens, p1 80 - 16.
    # p2 wins while 32 + backlog < 64; at 64 each the tie goes to the lower worker id.
    index = {11: {"p1", "p2"}, 22: {"p2"}, 33: {"p2"}}
    req = request(prompt=80, hashes=H)
    for p2_backlog, expected in ((0, "p2"), (31, "p2"), (32, "p1"), (33, "p1"), (5000, "p1")):
        p1 = view("p1", Role.PREFILL)
        p2 = view("p2", Role.PREFILL, queued_tokens=p2_backlog)
        result = _placed(place(snapshot(view("d1"), p1, p2, index=index), req))
        assert result.prefill is not None and result.prefill.worker_id == expected, p2_backlog
        assert result.expected_cached_tokens == (3 * BLOCK if expected == "p2" else BLOCK)
        assert result.mode is PrefillMode.DISAGGREGATED


def test_cache_aware_tie_goes_to_fewer_active_sequences_then_worker_id() -> None:
    index = {11: {"p1", "p2"}}
    req = request(prompt=80, hashes=H)
    p1 = view("p1", Role.PREFILL, running=2)
    p2 = view("p2", Role.PREFILL, running=1)
    assert _placed(place(snapshot(view("d1"), p1, p2, index=index), req)).prefill.worker_id == "p2"  # type: ignore[union-attr]
    p2 = view("p2", Role.PREFILL, running=2)
    assert _placed(place(snapshot(view("d1"), p1, p2, index=index), req)).prefill.worker_id == "p1"  # type: ignore[union-attr]


def test_only_leading_blocks_count_as_overlap() -> None:
    p1 = view("p1", Role.PREFILL)
    p2 = view("p2", Role.PREFILL)
    # p2 holds blocks 2..4 but not block 1: chained hashes make that useless.
    index = {11: {"p1"}, 22: {"p2"}, 33: {"p2"}, 44: {"p2"}}
    overlaps = prefix_overlaps([p1, p2], request(hashes=H), index)
    assert overlaps == {"p1": 1, "p2": 0}


def test_overlap_ignored_when_block_size_differs() -> None:
    p1 = view("p1", Role.PREFILL, cap=capacity(block_size=32))
    p2 = view("p2", Role.PREFILL, queued_tokens=10)
    index = {11: {"p1", "p2"}, 22: {"p1"}}
    overlaps = prefix_overlaps([p1, p2], request(hashes=H, hash_block_size=BLOCK), index)
    assert overlaps == {"p1": 0, "p2": 1}
    result = _placed(place(snapshot(view("d1"), p1, p2, index=index), request(hashes=H)))
    assert result.prefill is not None and result.prefill.worker_id == "p2"


def test_equal_overlap_ties_break_on_queued_prompt_tokens() -> None:
    p1 = view("p1", Role.PREFILL, queued_tokens=900)
    p2 = view("p2", Role.PREFILL, queued_tokens=100)
    p3 = view("p3", Role.PREFILL, queued_tokens=500)
    result = _placed(place(snapshot(view("d1"), p1, p2, p3), request()))
    assert result.prefill is not None and result.prefill.worker_id == "p2"
    assert result.expected_cached_tokens == 0


def test_full_prefill_backlog_is_skipped_then_rejected() -> None:
    limits = AdmissionLimits(max_queued_prompt_tokens=1000)
    full = view("p1", Role.PREFILL, queued_tokens=950)
    ok = view("p2", Role.PREFILL, queued_tokens=800)
    result = _placed(place(snapshot(view("d1"), full, ok, limits=limits), request(prompt=100)))
    assert result.prefill is not None and result.prefill.worker_id == "p2"
    both_full = snapshot(
        view("d1"), full, view("p2", Role.PREFILL, queued_tokens=990), limits=limits
    )
    rejection = _rejected(place(both_full, request(prompt=100)))
    assert rejection.reason is RejectReason.CAPACITY
    assert rejection.retry_after_ms == limits.retry_after_ms > 0


def test_idle_prefill_worker_takes_a_prompt_longer_than_the_backlog_cap() -> None:
    limits = AdmissionLimits(max_queued_prompt_tokens=64)
    result = _placed(
        place(snapshot(view("d1"), view("p1", Role.PREFILL), limits=limits), request(prompt=500))
    )
    assert result.prefill is not None


def test_prefill_needs_a_shared_transport_and_shm_needs_one_host() -> None:
    d = view("d1", transports=("shm",), host_id="hostA")
    p_other_host = view("p1", Role.PREFILL, transports=("shm",), host_id="hostB")
    p_same_host = view(
        "p2", Role.PREFILL, transports=("shm", "tcp"), host_id="hostA", queued_tokens=99
    )
    result = _placed(place(snapshot(d, p_other_host, p_same_host), request()))
    assert result.prefill is not None and result.prefill.worker_id == "p2"
    # Only the cross-host shm worker left: the decode worker prefills itself.
    result = _placed(place(snapshot(d, p_other_host), request()))
    assert result.prefill is None and result.mode is PrefillMode.LOCAL_FALLBACK


# ---- decode choice ----


def test_decode_prefers_fewer_running_sequences_then_more_free_blocks() -> None:
    busy = view("d1", running=5, free=900)
    idle_small = view("d2", running=1, free=100)
    idle_big = view("d3", running=1, free=800)
    result = _placed(place(snapshot(busy, idle_small, idle_big), request()))
    assert result.decode.worker_id == "d3"
    assert result.decode_kv_blocks == blocks_for(128, BLOCK) == 8


def test_pending_reservations_count_against_a_worker() -> None:
    a = view("d1", pending_seqs=2, pending_blocks=10)
    b = view("d2", running=1)
    assert _placed(place(snapshot(a, b), request())).decode.worker_id == "d2"
    # Reserved blocks are not free: d1 reports 10 free but 8 of them are reserved.
    tight = view("d1", free=10, pending_blocks=8)
    assert _rejected(place(snapshot(tight), request())).reason is RejectReason.CAPACITY


# ---- admission ----


def test_capacity_rejection_when_no_decode_worker_has_room() -> None:
    needs = blocks_for(128, BLOCK)
    d1 = view("d1", free=needs - 1)
    d2 = view("d2", running=8, waiting=64)  # every slot and queue place taken
    rejection = _rejected(place(snapshot(d1, d2, view("p1", Role.PREFILL)), request()))
    assert rejection.reason is RejectReason.CAPACITY
    assert rejection.retry_after_ms > 0
    d1_fits = view("d1", free=needs)
    assert _placed(place(snapshot(d1_fits, d2), request())).decode.worker_id == "d1"


def test_a_worker_s_room_counts_by_its_batch_target() -> None:
    exact = AdmissionLimits(max_waiting_per_worker=0)
    full = view("d1", running=2, target_batch=2)  # max_num_seqs 8, but 2 within its target
    rejection = _rejected(place(snapshot(full, limits=exact), request()))
    assert rejection.reason is RejectReason.CAPACITY
    assert "batch target" in rejection.message
    assert _placed(place(snapshot(view("d1", running=2, target_batch=3), limits=exact), request()))
    # no target reported: max_num_seqs; a target above max_num_seqs: max_num_seqs
    assert _placed(place(snapshot(view("d1", running=7), limits=exact), request()))
    over = view("d1", running=8, target_batch=20)
    assert _rejected(place(snapshot(over, limits=exact), request())).reason is RejectReason.CAPACITY
    # the waiting allowance still stands beyond the target (a heartbeat's lag)
    lagging = AdmissionLimits(max_waiting_per_worker=1)
    assert _placed(place(snapshot(full, limits=lagging), request()))
    # among workers with room, the one with fewer active sequences still goes first
    roomy = view("d2", running=3, target_batch=6)
    placed = place(snapshot(full, roomy, limits=exact), request())
    assert _placed(placed).decode.worker_id == "d2"


def test_a_placement_carries_the_fleet_target_batch() -> None:
    workers = (
        view("d1", target_batch=3),
        view("d2"),  # no target reported: its max_num_seqs, 8
        view("d3", target_batch=20),  # at most its max_num_seqs
        view("c1", Role.COLOCATED, target_batch=2),
        view("dead", target_batch=5, age=2 * TTL),
        view("drain", target_batch=5, state=WorkerState.DRAINING),
        view("other", target_batch=5, model="other"),
        view("p1", Role.PREFILL, target_batch=5),
    )
    req = request(model="m", exclude=frozenset({"d1"}))
    placed = _placed(place(snapshot(*workers), req))
    assert placed.fleet_target_batch == 3 + 8 + 8 + 2  # the excluded d1 is the fleet still


def test_request_larger_than_any_worker_never_fits() -> None:
    d1 = view("d1", cap=capacity(blocks=1000, model_len=2048))
    rejection = _rejected(place(snapshot(d1), request(prompt=2000, max_tokens=49)))
    assert rejection.reason is RejectReason.NEVER_FITS
    assert rejection.retry_after_ms == 0
    small_pool = view("d1", cap=capacity(blocks=4, model_len=4096))
    assert _rejected(place(snapshot(small_pool), request())).reason is RejectReason.NEVER_FITS


def test_global_inflight_cap() -> None:
    limits = AdmissionLimits(max_inflight=10)
    d1 = view("d1", running=4, waiting=2)
    d2 = view("d2", running=3, pending_seqs=1)
    rejection = _rejected(place(snapshot(d1, d2, limits=limits), request()))
    assert rejection.reason is RejectReason.INFLIGHT_CAP
    d2_less = view("d2", running=3)
    assert isinstance(place(snapshot(d1, d2_less, limits=limits), request()), Placement)


def test_unknown_model_and_model_matching() -> None:
    d1 = view("d1", model="llama")
    d2 = view("d2", model="smol", running=3)
    assert _rejected(place(snapshot(d1), request(model="gpt"))).reason is RejectReason.UNKNOWN_MODEL
    # No worker at all (a scheduler restarted cold): not known yet, so not unknown either.
    assert _rejected(place(snapshot(), request(model="gpt"))).reason is RejectReason.NO_LIVE_WORKER
    assert _placed(place(snapshot(d1, d2), request(model="smol"))).decode.worker_id == "d2"
    assert _placed(place(snapshot(d1, d2), request(model=""))).decode.worker_id == "d1"


# ---- local prefill ----


def test_no_prefill_worker_falls_back_to_local_prefill_on_decode() -> None:
    index = {11: {"d1"}, 22: {"d1"}}
    result = _placed(place(snapshot(view("d1"), index=index), request(hashes=H)))
    assert result.prefill is None
    assert result.mode is PrefillMode.LOCAL_FALLBACK
    assert result.expected_cached_tokens == 2 * BLOCK


def test_colocated_worker_prefills_its_own_prompts() -> None:
    result = _placed(
        place(snapshot(view("c1", Role.COLOCATED), view("p1", Role.PREFILL)), request())
    )
    assert result.prefill is None and result.mode is PrefillMode.LOCAL_COLOCATED


def test_short_prompts_prefill_locally_when_configured() -> None:
    limits = AdmissionLimits(local_prefill_max_tokens=64)
    cluster = snapshot(view("d1"), view("p1", Role.PREFILL), limits=limits)
    assert _placed(place(cluster, request(prompt=64))).mode is PrefillMode.LOCAL_SHORT_PROMPT
    assert _placed(place(cluster, request(prompt=65))).mode is PrefillMode.DISAGGREGATED


# ---- liveness ----


def test_dead_workers_are_excluded() -> None:
    dead_decode = view("d1", age=TTL + 0.01)
    live_decode = view("d2", running=7, age=TTL)  # exactly at the lease edge: still live
    dead_prefill = view("p1", Role.PREFILL, age=5.0)
    index = {11: {"p1"}, 22: {"p1"}}
    result = _placed(
        place(snapshot(dead_decode, live_decode, dead_prefill, index=index), request(hashes=H))
    )
    assert result.decode.worker_id == "d2"
    assert result.prefill is None and result.mode is PrefillMode.LOCAL_FALLBACK
    only_dead = snapshot(dead_decode, dead_prefill)
    assert _rejected(place(only_dead, request())).reason is RejectReason.NO_LIVE_WORKER


def test_draining_registered_and_excluded_workers_get_nothing() -> None:
    draining = view("d1", state=WorkerState.DRAINING)
    fresh = view("d2", state=WorkerState.REGISTERED)  # no heartbeat yet
    ok = view("d3", running=7)
    assert _placed(place(snapshot(draining, fresh, ok), request())).decode.worker_id == "d3"
    rejection = _rejected(place(snapshot(draining, fresh, ok), request(exclude=frozenset({"d3"}))))
    assert rejection.reason is RejectReason.NO_LIVE_WORKER
    p_excluded = view("p1", Role.PREFILL)
    p_ok = view("p2", Role.PREFILL, queued_tokens=500)
    result = _placed(place(snapshot(ok, p_excluded, p_ok), request(exclude=frozenset({"p1"}))))
    assert result.prefill is not None and result.prefill.worker_id == "p2"


def test_place_is_deterministic_and_pure() -> None:
    cluster = snapshot(view("d2"), view("d1"), view("p2", Role.PREFILL), view("p1", Role.PREFILL))
    first = place(cluster, request())
    assert first == place(cluster, request())
    placed = _placed(first)
    assert (placed.decode.worker_id, placed.prefill and placed.prefill.worker_id) == ("d1", "p1")


# ---- properties ----

# Weighted towards clusters where placement is possible, so both outcomes get exercised.
_roles = st.sampled_from([Role.DECODE, Role.DECODE, Role.PREFILL, Role.PREFILL, Role.COLOCATED])
_states = st.sampled_from(
    [WorkerState.SERVING] * 4 + [WorkerState.DRAINING, WorkerState.REGISTERED]
)


@st.composite
def _worker(draw: st.DrawFn, worker_id: str) -> WorkerView:
    cap = capacity(
        blocks=draw(st.integers(1, 400)),
        block_size=draw(st.sampled_from([8, 16])),
        seqs=draw(st.integers(1, 8)),
        model_len=draw(st.integers(256, 4096)),
    )
    return view(
        worker_id,
        draw(_roles),
        cap=cap,
        free=draw(st.integers(0, cap.total_kv_blocks)),
        running=draw(st.integers(0, 8)),
        waiting=draw(st.integers(0, 2)),
        queued_tokens=draw(st.integers(0, 2000)),
        # Mostly within the lease; a fifth of the workers are dead.
        age=draw(st.floats(0.0, TTL) if draw(st.integers(0, 4)) < 4 else st.floats(TTL, 3 * TTL)),
        state=WorkerState.SERVING if draw(st.integers(0, 4)) < 4 else draw(_states),
        model=draw(st.sampled_from(["a", "a", "a", "b"])),
        transports=draw(st.sampled_from([("tcp",), ("tcp",), ("shm",), ("shm", "tcp"), ()])),
        host_id=draw(st.sampled_from(["h1", "h2"])),
        pending_blocks=draw(st.integers(0, 20)),
        pending_seqs=draw(st.integers(0, 3)),
        target_batch=draw(st.integers(0, 10)),
    )


@st.composite
def _cluster(draw: st.DrawFn) -> tuple[list[WorkerView], dict[int, set[str]]]:
    n = draw(st.integers(1, 8))
    workers = [draw(_worker(f"w{i}")) for i in range(n)]
    ids = [w.worker_id for w in workers]
    index: dict[int, set[str]] = {}
    for h in H:
        holders = draw(st.sets(st.sampled_from(ids))) if ids else set()
        if holders:
            index[h] = holders
    return workers, index


_limits = st.builds(
    AdmissionLimits,
    max_inflight=st.integers(1, 400),
    max_waiting_per_worker=st.integers(0, 16),
    max_queued_prompt_tokens=st.integers(1, 8000),
    local_prefill_max_tokens=st.sampled_from([0, 32]),
    retry_after_ms=st.just(100),
)
_requests = st.builds(
    request,
    prompt=st.integers(1, 600),
    max_tokens=st.integers(1, 200),
    hashes=st.sampled_from([(), H[:1], H]),
    hash_block_size=st.sampled_from([8, 16]),
    exclude=st.frozensets(st.sampled_from([f"w{i}" for i in range(8)]), max_size=2),
    model=st.sampled_from(["", "a", "a", "a", "b"]),
)


def _usable(w: WorkerView, model: str, exclude: Sequence[str] | frozenset[str]) -> bool:
    return (
        is_live(w, NOW, TTL)
        and w.state is WorkerState.SERVING
        and w.worker_id not in exclude
        and model in ("", w.info.model)
    )


@settings(max_examples=400, deadline=None)
@given(cluster=_cluster(), limits=_limits, req=_requests)
def test_property_placement_only_picks_live_workers_with_room(
    cluster: tuple[list[WorkerView], dict[int, set[str]]],
    limits: AdmissionLimits,
    req: PlaceRequest,
) -> None:
    workers, index = cluster
    snap = snapshot(*workers, index=index, limits=limits)
    result = place(snap, req)
    by_id = {w.worker_id: w for w in workers}
    if isinstance(result, Rejection):
        # A rejection is justified: no usable decode worker has room, or (disaggregated)
        # every compatible prefill worker is full, or the in-flight cap is reached.
        usable_decoders = [
            w
            for w in workers
            if w.info.role.decodes and _usable(w, req.model, req.exclude_worker_ids)
        ]
        room = [w for w in usable_decoders if has_decode_room(w, req, limits)]
        inflight = sum(w.active_sequences for w in usable_decoders)
        no_prefill_pool = not any(
            w.info.role is Role.PREFILL and _usable(w, req.model, req.exclude_worker_ids)
            for w in workers
        )
        if room and inflight < limits.max_inflight and no_prefill_pool:
            raise AssertionError(f"rejected {result} although {room[0].worker_id} had room")
        return
    decode = by_id[result.decode.worker_id]
    assert decode.info.role.decodes
    assert _usable(decode, req.model, req.exclude_worker_ids)
    assert has_decode_room(decode, req, limits)
    assert decode.active_sequences < decode.batch_target + limits.max_waiting_per_worker
    assert 1 <= decode.batch_target <= decode.info.capacity.max_num_seqs
    assert result.fleet_target_batch >= decode.batch_target
    assert result.decode_kv_blocks <= decode.free_kv_blocks
    assert 0 <= result.expected_cached_tokens <= req.prompt_tokens
    if result.prefill is None:
        assert result.mode is not PrefillMode.DISAGGREGATED
    else:
        prefill = by_id[result.prefill.worker_id]
        # computing the prompt, or the fallback of a short local prefill
        assert result.mode is PrefillMode.DISAGGREGATED or (
            result.mode is PrefillMode.LOCAL_SHORT_PROMPT and result.local_prefill_max_tokens
        )
        assert prefill.info.role is Role.PREFILL
        assert _usable(prefill, req.model, req.exclude_worker_ids)
        assert has_prefill_room(prefill, req, limits)


# ---- routing policies and conditional disaggregation ----


def _prefill_of(result: Placement | Rejection) -> str:
    placed = _placed(result)
    assert placed.prefill is not None and placed.mode is PrefillMode.DISAGGREGATED, placed
    return placed.prefill.worker_id


def test_cache_aware_decode_prefers_the_holder_within_the_slack() -> None:
    index = {11: {"d2"}, 22: {"d2"}, 33: {"d2"}}  # d2 holds the conversation so far
    req = request(prompt=80, hashes=H)
    d1 = view("d1", running=1)
    for d2_running, expected in ((1, "d2"), (3, "d2"), (4, "d1")):
        d2 = view("d2", running=d2_running)
        result = _placed(place(snapshot(d1, d2, view("p1", Role.PREFILL), index=index), req))
        assert result.decode.worker_id == expected, d2_running
    limits = AdmissionLimits(local_prefill_max_tokens=0)
    blind = ClusterSnapshot(
        workers=(d1, view("d2", running=2), view("p1", Role.PREFILL)),
        prefix_index=index, now=NOW, lease_ttl_s=TTL, limits=limits,
        routing=Routing.LEAST_LOADED,
    )  # fmt: skip
    assert _placed(place(blind, req)).decode.worker_id == "d1"


def test_a_short_uncached_suffix_is_prefilled_on_the_decode_worker() -> None:
    # d1 holds 4 blocks (64 tokens) of an 80-token prompt: 16 tokens left to compute.
    index = {h: {"d1"} for h in H}
    req = request(prompt=80, hashes=H)
    workers = (view("d1"), view("p1", Role.PREFILL))
    local = _placed(place(snapshot(*workers, index=index), req))
    assert local.mode is PrefillMode.LOCAL_SHORT_PROMPT
    assert local.expected_cached_tokens == 64
    # The decode worker checks the suffix where it lands: the limit, and p1 past it.
    assert local.local_prefill_max_tokens == LOCAL_PREFILL_MAX_TOKENS
    assert local.prefill is not None and local.prefill.worker_id == "p1"
    # A prefill worker without room is no fallback: the placement names none.
    full = (view("d1"), view("p1", Role.PREFILL, queued_tokens=70000))
    local = _placed(place(snapshot(*full, index=index), req))
    assert local.mode is PrefillMode.LOCAL_SHORT_PROMPT and local.prefill is None
    # Not when the decode worker already has other uncomputed prompt tokens queued...
    busy = (view("d1", queued_tokens=20), view("p1", Role.PREFILL))
    assert _prefill_of(place(snapshot(*busy, index=index), req)) == "p1"
    # ...nor when it holds less, nor with the limit at 0, nor with cache-blind routing.
    assert _prefill_of(place(snapshot(*workers, index={11: {"d1"}}), req)) == "p1"
    off = AdmissionLimits(local_prefill_max_tokens=0)
    assert _prefill_of(place(snapshot(*workers, index=index, limits=off), req)) == "p1"
    blind = ClusterSnapshot(workers, index, NOW, TTL, routing=Routing.LEAST_LOADED)
    assert _prefill_of(place(blind, req)) == "p1"
    # Cache-blind routing still prefills a short prompt locally.
    short = request(prompt=32)
    assert _placed(place(blind, short)).mode is PrefillMode.LOCAL_SHORT_PROMPT


def _stored(*hashes: int, store: str = "kv:1") -> StoreIndex:
    index = StoreIndex()
    index.note(store, hashes)
    return index


def test_blocks_the_kv_store_holds_count_as_loaded_not_computed() -> None:
    # p1 caches 1 block of 5, p2 none, but their store holds 4: each would load up to 64
    # tokens and compute 16. Loading costs a hundredth of computing: p1 (loads 48) is
    # cheaper than p2 (loads 64) by one token, so a backlog of one token tips it.
    index = {11: {"p1"}}
    req = request(prompt=80, hashes=H)
    store = _stored(*H)
    for p1_backlog, expected in ((0, "p1"), (1, "p2"), (40, "p2")):
        p1 = view("p1", Role.PREFILL, queued_tokens=p1_backlog, kv_store="kv:1")
        p2 = view("p2", Role.PREFILL, kv_store="kv:1")
        got = _placed(place(snapshot(view("d1"), p1, p2, index=index, store_index=store), req))
        assert got.prefill is not None and got.prefill.worker_id == expected, p1_backlog
        assert got.expected_cached_tokens == 64  # cached or loaded: not computed
    # Without the store, the cache decides; a worker of another store, or none, loads nothing.
    p1, p2 = view("p1", Role.PREFILL, queued_tokens=10), view("p2", Role.PREFILL)
    assert _prefill_of(place(snapshot(view("d1"), p1, p2, index=index, store_index=store),
                             req)) == "p1"  # fmt: skip
    p2 = view("p2", Role.PREFILL, kv_store="kv:2")
    got = _placed(place(snapshot(view("d1"), p1, p2, index=index, store_index=store), req))
    assert got.prefill is not None and got.prefill.worker_id == "p1"
    assert got.expected_cached_tokens == BLOCK


def test_a_decode_worker_loads_a_stored_prefix_and_prefills_the_suffix_itself() -> None:
    # The store holds 4 blocks of an 80-token prompt: 16 tokens left, within the limit.
    req = request(prompt=80, hashes=H)
    workers = (view("d1", kv_store="kv:1"), view("p1", Role.PREFILL, kv_store="kv:1"))
    local = _placed(place(snapshot(*workers, store_index=_stored(*H)), req))
    assert local.mode is PrefillMode.LOCAL_SHORT_PROMPT and local.local_prefill_max_tokens
    assert local.expected_cached_tokens == 64
    # Once a worker reports the second block missing, the store is trusted no further.
    forgotten = _stored(*H)
    forgotten.forget("kv:1", [H[1]])
    assert _prefill_of(place(snapshot(*workers, store_index=forgotten), req)) == "p1"
    # A run with a hole is only its leading part: 64 tokens to compute, on p1.
    assert _prefill_of(place(snapshot(*workers, store_index=_stored(11, 33, 44)), req)) == "p1"


def test_the_last_prompt_token_is_never_counted_as_cached() -> None:
    # A 64-token prompt whose 4 blocks are all cached still computes its last token: the
    # engine hits only 3 blocks (48 tokens).
    index = {h: {"p1"} for h in H}
    off = AdmissionLimits(local_prefill_max_tokens=0)
    workers = (view("d1"), view("p1", Role.PREFILL))
    result = _placed(
        place(snapshot(*workers, index=index, limits=off), request(prompt=64, hashes=H))
    )
    assert result.expected_cached_tokens == 48


def test_least_loaded_prefill_ignores_the_cache() -> None:
    index = {11: {"p2"}, 22: {"p2"}, 33: {"p2"}}
    workers = (view("d1"), view("p1", Role.PREFILL), view("p2", Role.PREFILL, queued_tokens=1))
    req = request(prompt=80, hashes=H)
    assert _prefill_of(place(snapshot(*workers, index=index), req)) == "p2"
    blind = ClusterSnapshot(workers, index, NOW, TTL, routing=Routing.LEAST_LOADED)
    assert _prefill_of(place(blind, req)) == "p1"


def test_round_robin_continues_after_the_previous_placement() -> None:
    workers = (
        view("d1"), view("d2", running=5), view("p1", Role.PREFILL),
        view("p2", Role.PREFILL, queued_tokens=9999), view("p3", Role.PREFILL),
    )  # fmt: skip
    last_p, last_d = "", ""
    chosen = []
    for _ in range(4):
        snap = ClusterSnapshot(workers, {}, NOW, TTL, routing=Routing.ROUND_ROBIN,
                               last_prefill=last_p, last_decode=last_d)  # fmt: skip
        result = _placed(place(snap, request()))
        assert result.prefill is not None
        last_p, last_d = result.prefill.worker_id, result.decode.worker_id
        chosen.append((last_d, last_p))
    assert chosen == [("d1", "p1"), ("d2", "p2"), ("d1", "p3"), ("d2", "p1")]
    # A worker without room is skipped, not waited for.
    full = view("p2", Role.PREFILL, queued_tokens=70000)
    snap = ClusterSnapshot((workers[0], workers[2], full), {}, NOW, TTL,
                           routing=Routing.ROUND_ROBIN, last_prefill="p1")  # fmt: skip
    assert _prefill_of(place(snap, request())) == "p1"


def test_hashes_without_a_block_size_are_ignored() -> None:
    index = {11: {"p2"}}
    workers = (view("d1"), view("p1", Role.PREFILL), view("p2", Role.PREFILL))
    result = _placed(place(snapshot(*workers, index=index), request(hashes=H, hash_block_size=0)))
    assert result.prefill is not None and result.prefill.worker_id == "p1"
    assert result.expected_cached_tokens == 0

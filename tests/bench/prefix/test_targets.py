"""The figures of a run and the targets (pure): TTFT and compute halves, the per-turn KV
bound, and what is not judged."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.prefix.targets import KvLayout, RunFigures, bytes_checks, figures, targets
from bench.prefix.workers import WorkerCounters
from bench.serve.result import BenchResult, RequestRecord

LAYOUT = KvLayout(block_size=16, block_bytes=1000)


def rec(session: int, turn: int, prompt: int, completion: int, *, kv: int | None = 0,
        ttft: float = 0.1, cached: int = 0, error: str | None = None) -> RequestRecord:  # fmt: skip
    return RequestRecord(
        index=10 * session + turn, tag="later-turn" if turn else "first-turn", send_s=0.0,
        end_s=1.0, token_times_s=(ttft,), prompt_tokens=prompt, completion_tokens=completion,
        output_tokens_asked=32, status=200, error=error, cached_tokens=cached,
        kv_transfer_bytes=kv, session=session, turn=turn,
    )  # fmt: skip


def test_a_later_turn_may_move_its_new_tokens_kv_plus_one_block() -> None:
    result = BenchResult(
        (
            rec(0, 0, 100, 20, kv=7000),
            # new = 150 - (100 + 20) = 30 tokens: 2 blocks, + 1 = 3000 bytes
            rec(0, 1, 150, 10, kv=3000),
            rec(0, 2, 192, 10, kv=4000),  # new = 32: 2 blocks + 1 = 3000 < 4000
            rec(1, 0, 100, 5),
            rec(1, 1, 105, 5, kv=None),  # the server did not say; new = 0: bound 1 block
            rec(2, 0, 100, 5, error="boom"),
            rec(2, 1, 200, 5, kv=0),  # its previous turn failed: not checked
        ),
        duration_s=1.0,
    )
    checks = bytes_checks(result, LAYOUT)
    assert [(c.session, c.turn, c.new_tokens, c.bound_bytes, c.ok) for c in checks] == [
        (0, 1, 30, 3000, True), (0, 2, 32, 3000, False), (1, 1, 0, 1000, None),
    ]  # fmt: skip


def test_figures_prefer_the_workers_counters() -> None:
    result = BenchResult(
        (rec(0, 0, 100, 10, ttft=0.3), rec(0, 1, 150, 10, ttft=0.1, cached=110, kv=1000),
         rec(1, 0, 100, 10, ttft=0.2, error="x")),
        duration_s=1.0,
    )  # fmt: skip
    workers = {
        "prefill-0": WorkerCounters("prefill-0", cached=100.0, computed=140.0, kv_bytes=1000.0),
        "decode-0": WorkerCounters("decode-0", cached=10.0, computed=0.0, kv_bytes=1000.0),
    }
    f = figures("cache-aware", "multi-turn", result, workers, LAYOUT)
    assert (f.requests, f.failed, f.prompt_tokens, f.cached_tokens) == (3, 1, 250, 110)
    assert f.computed_tokens == 140 and f.worker_computed == 140.0
    assert f.ttft_p50_ms == pytest.approx(200.0) and f.later_ttft_p50_ms == pytest.approx(100.0)
    assert f.computed == (140.0, "workers")
    assert (f.bytes_ok, f.bytes_checked, f.bytes_unknown) == (1, 1, 0)
    missing = {**workers, "decode-1": WorkerCounters("decode-1", None, None, None)}
    g = figures("cache-aware", "multi-turn", result, missing, LAYOUT)
    assert g.worker_computed is None and g.computed == (140.0, "requests")


def _fig(policy: str, workload: str = "multi-turn", **kw: object) -> RunFigures:
    base = RunFigures(
        policy=policy, workload=workload, requests=8, failed=0, ttft_p50_ms=1000.0,
        later_ttft_p50_ms=900.0, e2e_p50_ms=2000.0, itl_p50_ms=50.0, itl_p99_ms=90.0,
        prompt_tokens=4000, computed_tokens=4000,
        cached_tokens=0, worker_computed=4000.0, kv_bytes_mean=1e6,
        later_kv_bytes_mean=1e6, bytes_ok=0, bytes_checked=6, bytes_unknown=0,
    )  # fmt: skip
    return replace(base, **kw)  # type: ignore[arg-type]


def test_the_targets_compare_cache_aware_with_round_robin() -> None:
    good = _fig("cache-aware", ttft_p50_ms=500.0, worker_computed=2000.0, bytes_ok=6)
    found = targets([_fig("round-robin"), _fig("least-loaded"), good])
    assert [t.passed for t in found] == [True, True, True]
    assert found[0].detail == "500 vs 1,000 ms (0.50x)"
    assert "tokens (workers)" in found[1].detail and "6/6" in found[2].detail
    slow = replace(good, ttft_p50_ms=501.0, bytes_ok=5)
    assert [t.passed for t in targets([_fig("round-robin"), slow])] == [False, True, False]
    # one side counted by the requests: said so
    mixed = targets([_fig("round-robin", worker_computed=None), good])
    assert "tokens (requests and workers)" in mixed[1].detail


def test_what_cannot_be_judged_is_not_judged() -> None:
    alone = targets([_fig("cache-aware", "shared-prefix")])
    assert [(t.passed, t.detail) for t in alone] == [(None, "not measured")] * 2
    unknown = targets([_fig("round-robin"), _fig("cache-aware", bytes_ok=5, bytes_unknown=1)])
    assert unknown[2].passed is None and "1 did not report bytes" in unknown[2].detail
    none_checked = targets([_fig("round-robin"), _fig("cache-aware", bytes_checked=0)])
    assert none_checked[2].passed is None


def test_long_document_compares_the_store_with_the_same_routing_without_it() -> None:
    off = _fig("cache-aware", "long-document", ttft_p50_ms=900.0, worker_computed=3000.0)
    on = _fig("cache-aware+store", "long-document", ttft_p50_ms=300.0, worker_computed=1000.0)
    found = targets([_fig("round-robin", "long-document"), off, on])
    assert [t.name for t in found] == [
        "long-document: cache-aware+store TTFT P50 <= 1/3 of cache-aware's",
        "long-document: cache-aware+store prompt tokens computed <= 1/3 of cache-aware's",
    ]
    assert [t.passed for t in found] == [True, True]
    assert found[0].detail == "300 vs 900 ms (0.33x)"
    worse = replace(on, ttft_p50_ms=301.0, worker_computed=1001.0)
    assert [t.passed for t in targets([off, worse])] == [False, False]

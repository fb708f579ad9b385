"""A worker's load report and its Prometheus gauges carry the same numbers."""

from __future__ import annotations

import dataclasses

from prometheus_client import REGISTRY

from engine.async_engine import EngineStats
from services.common.worker import load_snapshot, step_observer


def _stats(waiting: int, queued_prefill_tokens: int) -> EngineStats:
    return EngineStats(
        running=2,
        waiting=waiting,
        held=1,
        free_blocks=30,
        total_blocks=40,
        num_preemptions=0,
        queued_prefill_tokens=queued_prefill_tokens,
    )


def _gauge(name: str, role: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"role": role})


def test_gauges_follow_each_snapshot() -> None:
    # Two snapshots in a row: a gauge left at the first value fails the second check.
    for waiting, tokens in ((3, 1500), (1, 40)):
        snap = load_snapshot(_stats(waiting, tokens), "prefill")
        assert snap.queued_prompt_tokens == tokens
        assert _gauge("pdserve:num_prompt_tokens_waiting", "prefill") == tokens
        assert _gauge("pdserve:num_requests_waiting", "prefill") == waiting
        assert _gauge("pdserve:num_requests_running", "prefill") == 3  # running + held
        assert _gauge("pdserve:kv_cache_usage_perc", "prefill") == 0.25


def test_the_batch_target_and_itl_target_go_out_with_the_load() -> None:
    for target_batch, itl_target_s in ((7, 0.04), (3, 0.04), (64, 0.0)):
        stats = dataclasses.replace(
            _stats(0, 0), target_batch=target_batch, itl_target_s=itl_target_s
        )
        snap = load_snapshot(stats, "decode")
        assert snap.target_batch == target_batch
        assert _gauge("pdserve:target_batch_size", "decode") == target_batch
        # 2 running + 1 reserved, per sequence of the target
        assert _gauge("pdserve:batch_target_usage_perc", "decode") == 3 / target_batch
        assert _gauge("pdserve:itl_target_seconds", "decode") == itl_target_s


def test_step_batch_sizes_are_observed_for_steps_only() -> None:
    observe = step_observer("colocated")
    two, every = (_bucket("colocated", le) or 0.0 for le in ("2.0", "+Inf"))
    observe("step", 0.01, 2)
    observe("step", 0.01, 5)
    observe("prefill", 0.2, 1)  # a prefill batch is not a decode batch
    assert _bucket("colocated", "2.0") == two + 1
    assert _bucket("colocated", "+Inf") == every + 2


def _bucket(role: str, le: str) -> float | None:
    return REGISTRY.get_sample_value(
        "pdserve:engine_step_batch_size_bucket", {"role": role, "le": le}
    )

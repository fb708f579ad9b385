"""A worker's load report and its Prometheus gauges carry the same numbers."""

from __future__ import annotations

from prometheus_client import REGISTRY

from engine.async_engine import EngineStats
from services.common.worker import load_snapshot


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

"""The recommendation in words: the figures the planner computed, and the profile's origin."""

from __future__ import annotations

from dataclasses import replace

from bench.plan.model import Workload, plan
from bench.plan.report import format_recommendation
from tests.bench.plan.synthetic import linear_profile


def test_report_states_the_figures_and_where_the_profile_came_from() -> None:
    profile = replace(
        linear_profile(),
        model="/models/SmolLM2.gguf",
        created="2025-01-01T00:00:00+0000",
        machine={"cpu_count": 2, "load_before": [0.25, 0.5, 0.5]},
    )
    rec = plan(profile, Workload(2.0, 1000, 100, 1.0, 0.1, max_workers=10))
    text = format_recommendation(rec, profile)
    assert "Workload: 2 req/s, 1000 prompt + 100 output tokens" in text
    assert "at most 10 workers" in text
    assert "SmolLM2.gguf float32, measured 2025-01-01T00:00:00+0000" in text
    assert "under load average 0.25 on 2 CPUs" in text
    assert "ITL           24.9 ms on every gap" in text
    assert "utilisation   prefill 50%, decode 25%" in text
    assert "ITL P99       21.0 ms" in text  # colocated: stalls in < 1 % of gaps
    for reason in rec.reasons:
        assert f"  - {reason}" in text
    for warning in rec.warnings:
        assert f"  - {warning}" in text

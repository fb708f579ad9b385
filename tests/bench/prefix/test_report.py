"""The report (pure markdown, JSON-ready) and its figure, from a made-up run."""

from __future__ import annotations

import json
from pathlib import Path

from bench.prefix.config import PrefixConfig
from bench.prefix.plots import plot_report
from bench.prefix.report import PrefixReport, WorkloadRun, render
from bench.prefix.targets import KvLayout, figures
from bench.prefix.workers import WorkerCounters
from bench.serve.result import BenchResult, RequestRecord

LAYOUT = KvLayout(block_size=16, block_bytes=737_280)


def _result(ttft: float, cached: int) -> BenchResult:
    records = tuple(
        RequestRecord(
            index=2 * s + t, tag="later-turn" if t else "first-turn", send_s=0.0, end_s=2.0,
            token_times_s=(ttft * (t + 1), 1.9), prompt_tokens=300 + 200 * t, completion_tokens=8,
            output_tokens_asked=8, status=200, cached_tokens=cached * t,
            kv_transfer_bytes=LAYOUT.block_bytes * (3 if cached else 20), session=s, turn=t,
            prefill_worker_id="prefill-0", decode_worker_id="decode-1",
        )
        for s in range(2)
        for t in range(2)
    )  # fmt: skip
    return BenchResult(records, 2.0)


def report() -> PrefixReport:
    runs = []
    for policy, ttft, cached in (("round-robin", 0.8, 0), ("cache-aware", 0.2, 300)):
        result = _result(ttft, cached)
        workers = {"prefill-0": WorkerCounters("prefill-0", cached * 2.0, 100.0, 2e6),
                   "decode-1": WorkerCounters("decode-1", None, None, 2e6)}  # fmt: skip
        fig = figures(policy, "multi-turn", result, workers, LAYOUT)
        runs.append(WorkloadRun(policy, "multi-turn", result, workers, fig))
    cfg = PrefixConfig(policies=("round-robin", "cache-aware"), workloads=("multi-turn",))
    return PrefixReport(
        date="2026-12-01T00:00:00+00:00", command="python -m bench.prefix --turns 2",
        machine={"cpu_model": "Test CPU", "cpu_count": 2}, config=vars(cfg).copy(),
        layout=LAYOUT, wall_s=600.0, runs=runs,
    )  # fmt: skip


def test_the_markdown_has_the_command_the_date_the_tables_and_the_verdicts() -> None:
    text = render(report())
    assert "- date: 2026-12-01T00:00:00+00:00 (the run took 10.0 min)" in text
    assert "- command: `python -m bench.prefix --turns 2`" in text
    assert "multi-turn: 2 sessions x 2 turns" not in text  # the config's, not made up
    assert "multi-turn: 4 sessions x 4 turns" in text
    row = "| multi-turn | round-robin | 4 | 0 | 1,200 | 1,600 | 2,000 | 700 / 1,100 | 1,600 |"
    assert row in text
    assert "| multi-turn | cache-aware | prefill-0 | 600 | 100 | 85.7% | 1.91 |" in text
    assert "| multi-turn | cache-aware | decode-1 | - | - | - | 1.91 |" in text
    # TTFT 300 vs 1,200 ms passes; computed (a decode worker exports no counter: the
    # requests' usage) 1,000 vs 1,600 fails; 2/2 turns in bound
    assert "300 vs 1,200 ms (0.25x) | PASS |" in text
    assert "1,000 vs 1,600 tokens (requests) (0.62x) | FAIL |" in text
    assert "| 2/2 later turns within | PASS |" in text
    assert text.endswith("targets: FAIL (2/3 met)")
    assert "![TTFT and prompt tokens by routing policy](prefix.png)" in text
    assert "prefix.png" not in render(report(), plot=None)


def test_the_json_holds_every_request_and_the_figure_is_written(tmp_path: Path) -> None:
    data = json.loads(json.dumps(report().to_json()))
    run = data["runs"][1]
    assert run["policy"] == "cache-aware" and len(run["result"]["records"]) == 4
    assert run["workers"]["prefill-0"]["hit_rate"] == 600 / 700
    assert [c["ok"] for c in run["kv_bytes_checks"]] == [True, True]
    assert [t["passed"] for t in data["targets"]] == [True, False, True]
    path = tmp_path / "prefix.png"
    plot_report(report(), path)
    assert path.read_bytes()[:4] == b"\x89PNG"

"""The engine benchmark: its pure helpers on known inputs, and a real --quick run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench._common import markdown_table, median, percentile, rate, ratio
from bench.engine import (
    DecodeResult,
    PrefillResult,
    ThreadResult,
    build_rows,
    config_from_args,
    parse_args,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_median_and_percentile_on_known_inputs() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert median([7.0]) == 7.0
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 5.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile([10.0, 20.0], 25) == pytest.approx(12.5)
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_ratio_and_rate() -> None:
    assert ratio(6.0, 3.0) == 2.0
    assert ratio(1.0, 0.0) is None
    assert ratio(None, 2.0) is None
    assert ratio(2.0, None) is None
    assert rate(100, 0.5) == 200.0
    with pytest.raises(ValueError):
        rate(1, 0.0)


def test_markdown_table_rejects_ragged_rows() -> None:
    assert markdown_table(("a", "b"), [("1", "2")]) == "| a | b |\n|---|---|\n| 1 | 2 |"
    with pytest.raises(ValueError):
        markdown_table(("a", "b"), [("1",)])


def _result(threads: int = 1) -> ThreadResult:
    return ThreadResult(
        threads=threads,
        copy_bytes=10_000_000_000,
        copy_best_s=1.0,  # 10 GB/s
        weight_bytes=500_000_000,  # floor: 50 ms
        cpu_kernel=True,
        prefill=(
            # 1000 tokens: median 2 s -> 500 tok/s; transformers median 2.5 s -> 400 tok/s
            PrefillResult(1000, (2.0, 1.0, 9.0), (2.5, 2.5, 3.0)),
            # 100 tokens: 100 tok/s vs 200 tok/s
            PrefillResult(100, (1.0,), (0.5,)),
        ),
        decode=(
            # batch 1, 10 steps in 0.7 s: 70 ms/step (1.4x the floor), 14.3 tok/s
            DecodeResult(1, 10, (0.7, 0.6, 0.8), (1.0, 1.0, 1.0)),
            # batch 32, 10 steps: 320 tok / 1 s vs 320 tok / 1.5 s -> 1.5x, below 2x
            DecodeResult(32, 10, (1.0,), (1.5,)),
        ),
        load_before=(0.1, 0.1, 0.1),
        load_after=(0.2, 0.2, 0.2),
        wall_s=1.0,
    )


def test_build_rows_judges_targets() -> None:
    rows = {r.metric: r for r in build_rows([_result()])}
    long_prefill = rows["prefill 1000 tokens (tok/s)"]
    assert long_prefill.pdserve == "500.0" and long_prefill.transformers == "400.0"
    assert long_prefill.ratio == pytest.approx(1.25) and long_prefill.passed is True
    short_prefill = rows["prefill 100 tokens (tok/s)"]
    assert short_prefill.ratio == pytest.approx(0.5) and short_prefill.passed is False
    b1 = rows["decode batch 1 (tok/s, ms/step)"]
    assert b1.pdserve == "14.3 (70.0 ms)" and b1.passed is None  # no target at batch 1
    b32 = rows["decode batch 32 (tok/s, ms/step)"]
    assert b32.ratio == pytest.approx(1.5) and b32.passed is False
    floor = rows["decode batch 1 step ÷ bandwidth floor (ms)"]
    assert floor.ratio == pytest.approx(1.4) and floor.passed is True
    assert "50.0 ms" in floor.target


def test_rows_without_transformers_judge_only_the_floor() -> None:
    res = _result()
    bare = ThreadResult(
        **{
            **res.__dict__,
            "prefill": tuple(PrefillResult(p.tokens, p.pdserve_s, None) for p in res.prefill),
            "decode": tuple(DecodeResult(d.batch, d.steps, d.pdserve_s, None) for d in res.decode),
        }
    )
    rows = build_rows([bare])
    judged = [r for r in rows if r.passed is not None]
    assert [r.metric for r in judged] == ["decode batch 1 step ÷ bandwidth floor (ms)"]
    assert all(r.transformers == "—" for r in rows if r.metric.startswith("prefill"))


def test_json_round_trip() -> None:
    res = _result(threads=2)
    back = ThreadResult.from_json(json.loads(json.dumps(res.to_json())))
    assert back == res


def test_explicit_flags_override_quick_defaults() -> None:
    cfg = config_from_args(parse_args(["--quick", "--batches", "3"]))
    assert cfg.batches == (3,) and cfg.threads == (1,) and cfg.repeats == 2
    full = config_from_args(parse_args([]))
    assert full.threads == (1, 2) and full.prefill_lens == (128, 512, 1024, 2048)
    assert full.batches == (1, 8, 32) and full.context == 256 and full.transformers


def test_quick_run_reports_every_size(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.engine", "--quick", "--no-transformers", "--json", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    cfg = data["config"]
    assert [r["threads"] for r in data["results"]] == cfg["threads"] == [1]
    (res,) = data["results"]
    assert [p["tokens"] for p in res["prefill"]] == cfg["prefill_lens"]
    assert [d["batch"] for d in res["decode"]] == cfg["batches"]
    figures = [res["copy_gb_per_s"], res["floor_ms"], res["weight_bytes"]]
    figures += [p["pdserve_tok_s"] for p in res["prefill"]]
    figures += [d["pdserve_tok_s"] for d in res["decode"]]
    figures += [d["pdserve_step_ms"] for d in res["decode"]]
    assert all(math.isfinite(f) and f > 0 for f in figures), figures
    assert all(p["transformers_tok_s"] is None for p in res["prefill"])
    # SmolLM2-135M in float32: ~134.5 M parameters, tied head counted once.
    assert 500e6 < res["weight_bytes"] < 560e6
    assert "| threads | metric |" in proc.stdout

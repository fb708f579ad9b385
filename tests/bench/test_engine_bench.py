"""The engine benchmark: its pure helpers on known inputs, and a real --quick run (with
stand-in llama.cpp binaries: the real ones are a benchmark-only build)."""

from __future__ import annotations

import dataclasses
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
    SystemResult,
    ThreadResult,
    build_rows,
    config_from_args,
    format_table,
    measure_llama_cpp,
    parse_args,
)
from bench.peers.llama_bench import DecodeFigure, LlamaCppResult, PrefillFigure
from bench.peers.llama_server import BuildLayout
from tests.bench import fake_llama_cpp

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


def _system(weights: str, weight_bytes: int, scale: float = 1.0) -> SystemResult:
    """Figures with known medians; ``scale`` multiplies every time."""
    return SystemResult(
        weights=weights,
        weight_bytes=weight_bytes,
        prefill=(
            # 1000 tokens: median 2 s -> 500 tok/s (at scale 1)
            PrefillResult(1000, tuple(scale * t for t in (2.0, 1.0, 9.0))),
            PrefillResult(100, (scale * 1.0,)),  # 100 tok/s
        ),
        decode=(
            # batch 1, 10 steps in 0.7 s: 70 ms/step and ms/token, 14.3 tok/s
            DecodeResult(1, 10, tuple(scale * t for t in (0.7, 0.6, 0.8))),
            # batch 8, 10 steps in 0.8 s: 80 ms/step, 10 ms/token, 100 tok/s
            DecodeResult(8, 10, (scale * 0.8,)),
            # batch 32, 10 steps in 1 s: 320 tok/s
            DecodeResult(32, 10, (scale * 1.0,)),
        ),
    )


def _llama(threads: int = 1) -> LlamaCppResult:
    return LlamaCppResult(
        threads=threads,
        decode=(
            DecodeFigure(batch=1, context=256, gen_tokens=48, tg_s=48 * 0.050),  # 50 ms/token
            DecodeFigure(batch=8, context=256, gen_tokens=48, tg_s=48 * 0.100),  # 12.5 ms/token
            DecodeFigure(batch=32, context=256, gen_tokens=48, tg_s=48 * 0.320),  # 10 ms/token
        ),
        prefill=(PrefillFigure(1000, (250.0, 200.0, 300.0)), PrefillFigure(100, (400.0,))),
        commands=("llama-batched-bench ...", "llama-bench ..."),
    )


def _result(threads: int = 1, *, llama: bool = True) -> ThreadResult:
    return ThreadResult(
        threads=threads,
        copy_bytes=10_000_000_000,
        copy_best_s=1.0,  # 10 GB/s
        cpu_kernel=True,
        pdserve=(
            _system("quantized", 100_000_000),  # floor: 10 ms
            _system("float32", 500_000_000, scale=0.5),  # floor: 50 ms; twice as fast
        ),
        # transformers: 1000 tokens in 2.5 s (400 tok/s), 100 in 0.5 s (200 tok/s); decode
        # batch 1 in 1 s (10 tok/s), batch 8 in 1.6 s (50 tok/s), batch 32 in 1.5 s (213 tok/s)
        transformers=SystemResult(
            weights="float32",
            weight_bytes=500_000_000,
            prefill=(PrefillResult(1000, (2.5, 2.5, 3.0)), PrefillResult(100, (0.5,))),
            decode=(
                DecodeResult(1, 10, (1.0, 1.0, 1.0)),
                DecodeResult(8, 10, (1.6,)),
                DecodeResult(32, 10, (1.5,)),
            ),
        ),
        load_before=(0.1, 0.1, 0.1),
        load_after=(0.2, 0.2, 0.2),
        wall_s=1.0,
        llama_cpp=_llama(threads) if llama else None,
    )


def test_build_rows_judges_every_target() -> None:
    rows = {(r.weights, r.metric): r for r in build_rows([_result()])}
    assert len(rows) == 2 * (2 + 3 + 1)  # two weight groups: 2 prefill, 3 decode, 1 floor
    long_prefill = rows["quantized", "prefill 1000 tokens (tok/s, ms/token)"]
    assert (
        long_prefill.pdserve == "500.0 (2.0 ms)" and long_prefill.transformers == "400.0 (2.5 ms)"
    )
    assert long_prefill.llama_cpp == "250.0 (4.0 ms)"  # the median sample
    assert long_prefill.vs_transformers == pytest.approx(1.25) and long_prefill.passed is True
    assert long_prefill.vs_llama_cpp == pytest.approx(0.5)  # beside, not judged
    short_prefill = rows["quantized", "prefill 100 tokens (tok/s, ms/token)"]
    assert short_prefill.vs_transformers == pytest.approx(0.5) and short_prefill.passed is False

    b1 = rows["quantized", "decode batch 1 (tok/s, ms/token)"]
    assert b1.pdserve == "14.3 (70.0 ms)" and b1.llama_cpp == "20.0 (50.0 ms)"
    assert b1.vs_llama_cpp == pytest.approx(1.4) and b1.judged == b1.vs_llama_cpp
    assert b1.passed is False and "llama.cpp" in b1.target
    b8 = rows["quantized", "decode batch 8 (tok/s, ms/token)"]
    assert b8.pdserve == "100.0 (10.0 ms)" and b8.llama_cpp == "80.0 (12.5 ms)"
    assert b8.vs_llama_cpp == pytest.approx(0.8) and b8.passed is True
    assert b8.vs_transformers == pytest.approx(2.0)  # shown, not judged at batch 8
    b32 = rows["quantized", "decode batch 32 (tok/s, ms/token)"]
    assert b32.vs_transformers == pytest.approx(1.5) and b32.judged == pytest.approx(1.5)
    assert b32.passed is False and "transformers" in b32.target
    assert b32.vs_llama_cpp == pytest.approx(1.0 / 0.32 / 10)  # 3.125 ms vs 10 ms per token

    floor = rows["quantized", "decode batch 1 step ÷ bandwidth floor (ms)"]
    assert floor.judged == pytest.approx(7.0) and floor.passed is False
    assert "10.0 ms" in floor.target and floor.llama_cpp == "50.0"

    # The float32 group: pdserve twice as fast, the same transformers and llama.cpp cells.
    f32_b1 = rows["float32", "decode batch 1 (tok/s, ms/token)"]
    assert f32_b1.vs_llama_cpp == pytest.approx(0.7) and f32_b1.passed is True
    assert f32_b1.transformers == b1.transformers and f32_b1.llama_cpp == b1.llama_cpp
    f32_floor = rows["float32", "decode batch 1 step ÷ bandwidth floor (ms)"]
    assert f32_floor.judged == pytest.approx(0.7) and "50.0 ms" in f32_floor.target


def test_rows_group_by_threads_then_weights() -> None:
    rows = build_rows([_result(1), _result(2)])
    groups = [(r.threads, r.weights) for r in rows]
    assert list(dict.fromkeys(groups)) == [
        (1, "quantized"), (1, "float32"), (2, "quantized"), (2, "float32"),
    ]  # fmt: skip
    table = format_table(rows)
    assert table.count("\n") == len(rows) + 1
    assert "| 1 | quantized | decode batch 8 (tok/s, ms/token) | 100.0 (10.0 ms) |" in table
    assert "FAIL (1.40×)" in table and "pass (0.80×)" in table


def test_rows_without_references_judge_only_the_floor() -> None:
    bare = dataclasses.replace(_result(llama=False), transformers=None)
    rows = build_rows([bare])
    judged = [r for r in rows if r.passed is not None]
    assert [r.metric for r in judged] == ["decode batch 1 step ÷ bandwidth floor (ms)"] * 2
    assert all(r.transformers == "—" and r.llama_cpp == "—" for r in rows)
    assert all(r.vs_llama_cpp is None and r.vs_transformers is None for r in rows)


def test_json_round_trip() -> None:
    for res in (_result(threads=2), _result(llama=False)):
        back = ThreadResult.from_json(json.loads(json.dumps(res.to_json())))
        assert back == res


def test_explicit_flags_override_quick_defaults() -> None:
    cfg = config_from_args(parse_args(["--quick", "--batches", "3"]))
    assert cfg.batches == (3,) and cfg.threads == (1,) and cfg.repeats == 2
    assert cfg.weights == ("quantized",) and cfg.llama_cpp
    full = config_from_args(parse_args([]))
    assert full.threads == (1, 2) and full.prefill_lens == (128, 512, 1024, 2048)
    assert full.batches == (1, 8, 32) and full.context == 256 and full.transformers
    assert full.weights == ("quantized",) and full.llama_cpp and full.llama_cpp_dir is None
    both = config_from_args(parse_args(["--weights", "float32", "quantized", "--no-llama-cpp"]))
    assert both.weights == ("float32", "quantized") and not both.llama_cpp
    with pytest.raises(ValueError):
        config_from_args(parse_args(["--weights", "float32", "float32"]))
    with pytest.raises(SystemExit):
        parse_args(["--weights", "int3"])


def test_llama_cpp_is_skipped_with_a_reason(tmp_path: Path) -> None:
    cfg = config_from_args(parse_args(["--quick"]))
    res, why = measure_llama_cpp(cfg, 1, BuildLayout(tmp_path / "none"))
    assert res is None and why is not None and "python -m bench.peers.llama_server build" in why
    layout = fake_llama_cpp.install(tmp_path / "fake")
    hf_dir = dataclasses.replace(cfg, model=str(tmp_path))
    res, why = measure_llama_cpp(hf_dir, 1, layout)
    assert res is None and why is not None and "GGUF" in why
    res, why = measure_llama_cpp(cfg, 1, layout)
    assert why is None and res is not None
    assert [d.batch for d in res.decode] == list(cfg.batches)
    assert [p.tokens for p in res.prefill] == list(cfg.prefill_lens)
    assert res.decode[0].gen_tokens == cfg.decode_steps * cfg.repeats
    assert res.decode[0].context == cfg.context


@pytest.mark.slow  # a bench's whole run (its parts are tested above); -m slow runs it
def test_quick_run_reports_every_size(tmp_path: Path) -> None:
    out = tmp_path / "engine.json"
    fake = fake_llama_cpp.install(tmp_path / "llama.cpp")
    cmd = [sys.executable, "-m", "bench.engine", "--quick", "--no-transformers"]
    cmd += ["--weights", "float32", "--llama-cpp-dir", str(fake.cache_dir), "--json", str(out)]
    proc = subprocess.run(
        cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=400, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    cfg = data["config"]
    assert [r["threads"] for r in data["results"]] == cfg["threads"] == [1]
    (res,) = data["results"]
    (ours,) = res["pdserve"]
    assert ours["weights"] == "float32" and res["transformers"] is None
    assert [p["tokens"] for p in ours["prefill"]] == cfg["prefill_lens"]
    assert [d["batch"] for d in ours["decode"]] == cfg["batches"]
    figures = [res["copy_gb_per_s"], ours["floor_ms"], ours["weight_bytes"]]
    figures += [p["tok_s"] for p in ours["prefill"]]
    figures += [d[k] for d in ours["decode"] for k in ("tok_s", "step_ms", "ms_per_token")]
    assert all(math.isfinite(f) and f > 0 for f in figures), figures
    # SmolLM2-135M in float32: ~134.5 M parameters, tied head counted once.
    assert 500e6 < ours["weight_bytes"] < 560e6
    llama = res["llama_cpp"]
    assert [d["batch"] for d in llama["decode"]] == cfg["batches"]
    assert [p["tokens"] for p in llama["prefill"]] == cfg["prefill_lens"]
    assert "| threads | weights | metric |" in proc.stdout
    step_ms = 1000 * (fake_llama_cpp.STEP_S + fake_llama_cpp.PER_SEQ_S)
    assert f"{1000 / step_ms:.1f} ({step_ms:.1f} ms)" in proc.stdout  # batch 1's llama.cpp cell
    assert all(r["llama_cpp"] != "—" for r in data["rows"]), data["rows"]
    assert data["llama_cpp_skipped"] == []


def test_decode_timing_holds_a_batch_prefilled_over_several_steps(tmp_path: Path) -> None:
    # A step's token budget holds one prompt: the batch starts over four steps and its first
    # sequences decode meanwhile; every timed step must still carry the whole batch.
    import torch

    from bench.engine import _engine_decode_s
    from engine.checkpoint import default_model_path
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.tokenizer import Tokenizer
    from tests.engine.tiny_models import write_tiny_gguf

    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model)
    cfg = EngineConfig(model=str(model), num_kv_blocks=64, max_num_batched_tokens=48)
    engine = LLMEngine(cfg, tokenizer=Tokenizer.from_path(default_model_path()))
    prompts = torch.randint(5, 200, (4, 40), generator=torch.Generator().manual_seed(0))
    times = _engine_decode_s(engine, prompts, steps=3, repeats=2)
    assert len(times) == 2 and min(times) > 0
    assert not engine.has_unfinished()

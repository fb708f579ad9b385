"""llama.cpp's bench tools as a peer: command lines, the parsers on output captured from the
real binaries (``fixtures/``), and ``measure`` against stand-in binaries (``fake_llama_cpp``).

Nothing here needs llama.cpp built.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

from bench.peers.llama_bench import (
    LlamaCppError,
    LlamaCppResult,
    batched_bench_command,
    batched_bench_ctx,
    build_hint,
    llama_bench_command,
    measure,
    parse_batched_bench,
    parse_llama_bench,
)
from bench.peers.llama_server import BuildLayout
from tests.bench import fake_llama_cpp

FIXTURES = Path(__file__).parent / "fixtures"
# Captured with the commands in fixtures/README.md (1 thread, SmolLM2-135M Q4_1).
BATCHED = (FIXTURES / "llama_batched_bench.jsonl").read_text()
BENCH = (FIXTURES / "llama_bench.json").read_text()


def flag_value(cmd: list[str], flag: str) -> str:
    assert cmd.count(flag) == 1, f"{flag} appears {cmd.count(flag)} times in {cmd}"
    return cmd[cmd.index(flag) + 1]


def test_batched_bench_command_fits_the_largest_batch() -> None:
    cmd = batched_bench_command(
        Path("/b/llama-batched-bench"), Path("/m.gguf"), threads=2, context=256,
        gen_tokens=48, batches=(1, 8, 32),
    )  # fmt: skip
    assert cmd[0] == "/b/llama-batched-bench" and flag_value(cmd, "--model") == "/m.gguf"
    assert flag_value(cmd, "-npp") == "256" and flag_value(cmd, "-ntg") == "48"
    assert flag_value(cmd, "-npl") == "1,8,32"
    assert flag_value(cmd, "--threads") == flag_value(cmd, "--threads-batch") == "2"
    assert flag_value(cmd, "--output-format") == "jsonl" and "--no-kv-unified" in cmd
    # every sequence gets 256 + 48 cells, padded to llama.cpp's 256 per sequence
    assert flag_value(cmd, "--ctx-size") == str(32 * 512)
    assert batched_bench_ctx(32, 8, (1, 8)) == 8 * 256
    assert batched_bench_ctx(256, 0, (4,)) == 4 * 256
    with pytest.raises(ValueError):
        batched_bench_ctx(32, 8, ())
    with pytest.raises(ValueError):
        batched_bench_command(
            Path("b"), Path("m"), threads=0, context=1, gen_tokens=1, batches=(1,)
        )


def test_llama_bench_command_runs_prompts_only() -> None:
    cmd = llama_bench_command(
        Path("/b/llama-bench"), Path("/m.gguf"), threads=1, prompt_lens=(128, 512), repeats=3
    )
    assert flag_value(cmd, "--n-prompt") == "128,512" and flag_value(cmd, "--n-gen") == "0"
    assert flag_value(cmd, "--threads") == "1" and flag_value(cmd, "--repetitions") == "3"
    assert flag_value(cmd, "--output") == "json"
    with pytest.raises(ValueError):
        llama_bench_command(Path("b"), Path("m"), threads=1, prompt_lens=(), repeats=1)


def test_parse_batched_bench_on_real_output() -> None:
    rows = [json.loads(line) for line in BATCHED.splitlines() if line.startswith("{")]
    figures = parse_batched_bench(BATCHED, threads=1, context=32, gen_tokens=8, batches=(8, 1))
    assert [f.batch for f in figures] == [8, 1]  # in the order asked for
    for fig in figures:
        (row,) = [r for r in rows if r["pl"] == fig.batch]
        assert (fig.context, fig.gen_tokens, fig.tg_s) == (32, 8, row["t_tg"])
        assert fig.tok_s == pytest.approx(row["speed_tg"], rel=1e-4)
        assert fig.step_ms == pytest.approx(1000 * row["t_tg"] / 8)
        assert fig.ms_per_token == pytest.approx(fig.step_ms / fig.batch)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batches": (1, 8, 32)}, r"no figures for batch \[32\]"),  # skipped: KV did not fit
        ({"batches": (1,)}, "not asked"),  # a batch size nobody asked for
        ({"context": 64}, "not asked"),
        ({"gen_tokens": 16}, "not asked"),
        ({"threads": 2}, "threads"),
    ],
)
def test_parse_batched_bench_rejects_output_for_other_sizes(
    kwargs: dict[str, object], match: str
) -> None:
    asked: dict[str, object] = {"threads": 1, "context": 32, "gen_tokens": 8, "batches": (1, 8)}
    with pytest.raises(LlamaCppError, match=match):
        parse_batched_bench(BATCHED, **{**asked, **kwargs})  # type: ignore[arg-type]


def test_parse_batched_bench_rejects_garbage() -> None:
    with pytest.raises(LlamaCppError, match="no figures"):
        parse_batched_bench("main: nothing\n", threads=1, context=32, gen_tokens=8, batches=(1,))
    with pytest.raises(LlamaCppError, match="bad batched-bench line"):
        parse_batched_bench('{"pp": 32}\n', threads=1, context=32, gen_tokens=8, batches=(1,))


def test_parse_llama_bench_on_real_output() -> None:
    tests = {t["n_prompt"]: t for t in json.loads(BENCH)}
    figures = parse_llama_bench(BENCH, threads=1, prompt_lens=(64, 16))
    assert [f.tokens for f in figures] == [64, 16]
    for fig in figures:
        test = tests[fig.tokens]
        assert fig.samples_tok_s == tuple(test["samples_ts"]) and len(fig.samples_tok_s) == 2
        assert fig.tok_s == pytest.approx(statistics.median(test["samples_ts"]))
        assert fig.tok_s == pytest.approx(test["avg_ts"])  # the mean, for two samples
        assert fig.ms_per_token == pytest.approx(1000 / fig.tok_s)


def test_parse_llama_bench_rejects_other_sizes_and_garbage() -> None:
    with pytest.raises(LlamaCppError, match=r"prompt length \[512\]"):
        parse_llama_bench(BENCH, threads=1, prompt_lens=(16, 64, 512))
    with pytest.raises(LlamaCppError, match="not asked"):
        parse_llama_bench(BENCH, threads=1, prompt_lens=(16,))
    with pytest.raises(LlamaCppError, match="threads"):
        parse_llama_bench(BENCH, threads=2, prompt_lens=(16, 64))
    with pytest.raises(LlamaCppError):
        parse_llama_bench("error: failed to load model\n", threads=1, prompt_lens=(16,))
    with pytest.raises(LlamaCppError):
        parse_llama_bench("[\n  {\n", threads=1, prompt_lens=(16,))


def test_measure_runs_both_tools(tmp_path: Path) -> None:
    layout = fake_llama_cpp.install(tmp_path)
    res = measure(
        Path("/m.gguf"), threads=2, context=256, gen_tokens=48, batches=(1, 8, 32),
        prompt_lens=(128, 512), repeats=3, layout=layout, timeout_s=60,
    )  # fmt: skip
    assert [d.batch for d in res.decode] == [1, 8, 32] and res.threads == 2
    for d in res.decode:
        step_s = fake_llama_cpp.STEP_S + fake_llama_cpp.PER_SEQ_S * d.batch
        assert d.step_ms == pytest.approx(1000 * step_s)
        assert d.tok_s == pytest.approx(d.batch / step_s)
    assert [(p.tokens, p.tok_s) for p in res.prefill] == [(128, 129.0), (512, 513.0)]
    assert res.decode_at(8) is res.decode[1] and res.decode_at(4) is None
    assert res.prefill_at(512) is res.prefill[1] and res.prefill_at(64) is None
    assert len(res.commands) == 2 and str(layout.batched_bench_binary) in res.commands[0]
    assert LlamaCppResult.from_json(json.loads(json.dumps(res.to_json()))) == res


def test_measure_says_how_to_build_when_binaries_are_missing(tmp_path: Path) -> None:
    layout = BuildLayout(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"bench\.peers\.llama_server build"):
        measure(
            Path("/m.gguf"), threads=1, context=8, gen_tokens=2, batches=(1,),
            prompt_lens=(8,), repeats=1, layout=layout,
        )  # fmt: skip
    assert "llama-batched-bench" in build_hint(layout)


def test_measure_turns_failures_and_timeouts_into_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout = fake_llama_cpp.install(tmp_path)

    def run(timeout_s: float) -> LlamaCppResult:
        return measure(
            Path("/m.gguf"), threads=1, context=8, gen_tokens=2, batches=(1,),
            prompt_lens=(8,), repeats=1, layout=layout, timeout_s=timeout_s,
        )  # fmt: skip

    monkeypatch.setenv("FAKE_LLAMA_SLEEP_S", "5")
    with pytest.raises(LlamaCppError, match="timed out"):
        run(0.5)
    monkeypatch.delenv("FAKE_LLAMA_SLEEP_S")
    assert run(30).decode[0].batch == 1
    layout.bench_binary.write_text("#!/bin/sh\necho 'error: bad model' >&2\nexit 3\n")
    os.chmod(layout.bench_binary, 0o755)
    with pytest.raises(LlamaCppError, match="exited 3: error: bad model"):
        run(30)

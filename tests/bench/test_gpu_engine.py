"""bench.gpu.engine on the CPU with a tiny model: it times decode steps at each batch size
and a prefill, and says what it ran on (the figures of record come from a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.gpu import engine as gpu_engine
from tests.engine.tiny_models import write_tiny_hf_checkpoint


def test_it_times_decode_per_batch_and_prefill(tmp_path: Path) -> None:
    model = write_tiny_hf_checkpoint(tmp_path / "tiny", seed=2)
    out = tmp_path / "engine.json"
    # a prefill longer than the decode contexts, as the GPU defaults are (2,048 vs 512)
    argv = ["--model", str(model), "--device", "cpu", "--batches", "1", "3", "--context", "20",
            "--prefill-tokens", "48", "--iters", "2", "--json", str(out)]  # fmt: skip
    assert gpu_engine.main(argv) == 0
    result = json.loads(out.read_text())
    assert (result["device"], result["dtype"], result["triton_kernels"]) == (
        "cpu", "float32", False,
    )  # fmt: skip
    assert [row["batch"] for row in result["decode"]] == [1, 3]
    for row in result["decode"]:
        assert row["step_ms"] > 0
        assert row["tokens_per_s"] == pytest.approx(row["batch"] / (row["step_ms"] / 1e3))
    assert result["prefill"]["tokens"] == 48 and result["prefill"]["tokens_per_s"] > 0


def test_nonsense_sizes_are_refused(capsys) -> None:
    assert gpu_engine.main(["--device", "cpu", "--iters", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_the_report_tables_what_ran_and_says_what_did_not(tmp_path: Path, capsys) -> None:
    from bench.gpu import report as gpu_report

    assert gpu_report.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("not run") == 4
    (tmp_path / "gpu-tests.xml").write_text(
        '<testsuites><testsuite tests="9" failures="1" errors="0" skipped="2"/></testsuites>'
    )
    model = write_tiny_hf_checkpoint(tmp_path / "tiny", seed=2)
    out = str(tmp_path / "gpu-engine.json")
    argv = ["--model", str(model), "--device", "cpu", "--batches", "2", "--context", "20",
            "--prefill-tokens", "16", "--iters", "1", "--json", out]  # fmt: skip
    assert gpu_engine.main(argv) == 0
    capsys.readouterr()
    assert gpu_report.main([str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "6 passed, 1 failed, 0 errors, 2 skipped" in table
    assert "decode step, batch 2" in table and "prefill, 16 tokens" in table
    assert table.count("not run") == 2  # the kernel and transfer benchmarks
    assert gpu_report.main([str(tmp_path / "missing")]) == 2

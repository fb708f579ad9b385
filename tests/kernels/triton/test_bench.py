"""bench.gpu.kernels on tiny shapes under the interpreter: it measures, and it refuses to
report a kernel whose output disagrees with the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import kernels.triton.decode_attention as decode_attention
from bench.gpu import kernels as gpu_kernels
from kernels.triton.checks import interpreting

TINY = ["--batch", "2", "--context", "40", "--heads", "6", "--kv-heads", "2", "--head-dim",
        "16", "--block-size", "8", "--dtype", "float32", "--iters", "1"]  # fmt: skip


@pytest.fixture(autouse=True)
def _interpreted() -> None:
    if not interpreting():
        pytest.skip("the tiny shapes are for the interpreter; a GPU runs the real ones")


def test_it_reports_bandwidths_and_the_error(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    assert gpu_kernels.main(["--device", "cpu", *TINY, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kv_bytes"] == 2 * 2 * 40 * 2 * 16 * 4
    assert result["attention_gbs"] > 0 and result["copy_gbs"] > 0
    assert result["ratio"] == pytest.approx(result["attention_gbs"] / result["copy_gbs"])
    assert result["max_abs_error"] <= result["tolerance"]


def test_a_wrong_kernel_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        decode_attention, "paged_decode_attention_reference",
        lambda q, *args: torch.zeros_like(q),
    )  # fmt: skip
    assert gpu_kernels.main(["--device", "cpu", *TINY]) == 1


def test_sizes_below_one_are_usage_errors() -> None:
    with pytest.raises(SystemExit) as e:
        gpu_kernels.main(["--device", "cpu", *TINY, "--batch", "0"])
    assert e.value.code == 2

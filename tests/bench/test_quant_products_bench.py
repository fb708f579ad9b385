"""bench.quant_products: the three ways of a packed product measured on a real (tiny) quantized
GGUF, the table's ratios taken repeat by repeat, dense checkpoints and bad flags refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from bench.quant_products import Figure, format_table, main
from tests.engine.tiny_models import write_tiny_gguf

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_table_takes_ratios_repeat_by_repeat_and_names_the_kernel_taken() -> None:
    figures = [
        Figure(4, (10.0, 20.0, 12.0), (20.0, 30.0, 24.0), (40.0, 60.0, 48.0)),
        Figure(32, (40.0,), (30.0,), (60.0,)),
        Figure(256, (80.0,), (60.0,), (50.0,)),
    ]
    table = format_table(figures)  # QuantLinear's picks: fused to 4 rows, gemm from 256
    assert "| 4 | 12.0 | 24.0 | 48.0 | 2.00× (1.50–2.00) | 0.50× (0.50–0.50) | fused |" in table
    assert "| 32 | 40.0 | 30.0 | 60.0 | 0.75× (0.75–0.75) | 0.50× (0.50–0.50) | tiled |" in table
    assert "| 256 | 80.0 | 60.0 | 50.0 | 0.75× (0.75–0.75) | 1.20× (1.20–1.20) | gemm |" in table


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "bench.quant_products", *args]
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def test_small_run_measures_every_way(tmp_path: Path) -> None:
    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model, tensor_type=gguf.GGMLQuantizationType.Q4_1, hidden=128, intermediate=256)
    out = tmp_path / "products.json"
    proc = _run("--model", str(model), "--batches", "2", "30", "--repeats", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "| 2 |" in proc.stdout and "| fused |" in proc.stdout and "| tiled |" in proc.stdout
    payload = json.loads(out.read_text())
    assert payload["fused_rows"] == 4 and payload["gemm_rows"] == 256
    assert [f["batch"] for f in payload["figures"]] == [2, 30]
    for f in payload["figures"]:
        assert len(f["fused_ms"]) == len(f["tiled_ms"]) == len(f["gemm_ms"]) == 2
        assert min(f["fused_ms"] + f["tiled_ms"] + f["gemm_ms"]) > 0


def test_a_checkpoint_without_packed_weights_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "dense.gguf"
    write_tiny_gguf(model, tensor_type=gguf.GGMLQuantizationType.F32)
    proc = _run("--model", str(model), "--batches", "2", "--repeats", "1")
    assert proc.returncode != 0
    assert "no packed layer weights" in proc.stderr


@pytest.mark.parametrize("flag", ["--threads", "--repeats", "--batches"])
def test_bad_flags_are_refused(flag: str) -> None:
    with pytest.raises(SystemExit):
        main([flag, "0"])

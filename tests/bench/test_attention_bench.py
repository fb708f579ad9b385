"""bench.attention: runs the real kernel on small pools, both placements and dtypes, and its
table reports per-repeat ratios; bad flags are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.attention import Figure, format_table, main

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_table_takes_ratios_repeat_by_repeat() -> None:
    figures = [
        Figure("memory", "float32", (10.0, 20.0, 12.0)),
        Figure("memory", "float16", (5.0, 18.0, 6.0)),
        Figure("cache", "float32", (4.0, 4.0, 4.0)),
        Figure("cache", "float16", (4.4, 4.0, 4.8)),
    ]
    table = format_table(figures)
    assert "| memory | 12.00 | 6.00 | 0.50× (0.50–0.90) |" in table
    assert "| cache | 4.00 | 4.40 | 1.10× (1.00–1.20) |" in table


def test_small_run_measures_every_case(tmp_path: Path) -> None:
    out = tmp_path / "attn.json"
    cmd = [sys.executable, "-m", "bench.attention", "--batch", "2", "--context", "40",
           "--layers", "2", "--repeats", "2", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "| memory |" in proc.stdout and "| cache |" in proc.stdout
    figures = json.loads(out.read_text())["figures"]
    assert {(f["placement"], f["dtype"]) for f in figures} == {
        (p, d) for p in ("memory", "cache") for d in ("float32", "float16")
    }
    assert all(len(f["step_ms"]) == 2 and min(f["step_ms"]) > 0 for f in figures)


@pytest.mark.parametrize("flag", ["--batch", "--context", "--repeats"])
def test_bad_flags_are_refused(flag: str) -> None:
    with pytest.raises(SystemExit):
        main([flag, "0"])

"""bench.decode_ab: pdserve's engine and llama.cpp (a fake with known timings) take turns,
repeat by repeat, and the table and JSON say what each repeat measured."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.decode_ab import BatchResult, format_table, parse_args
from tests.bench import fake_llama_cpp

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_ratios_are_per_repeat_and_the_table_shows_them() -> None:
    r = BatchResult(8, pdserve_ms=(90.0, 100.0, 120.0), llama_cpp_ms=(100.0, 80.0, 100.0))
    assert r.ratios == pytest.approx((0.9, 1.25, 1.2))
    data = r.to_json()
    assert data["ratio_median"] == pytest.approx(1.2)
    assert data["pdserve_median_ms"] == 100.0 and data["llama_cpp_median_ms"] == 100.0
    table = format_table(1, [r])
    assert (
        "| 1 | 8 | 100.0 | 100.0 | 1.20× (0.90–1.25) | 90.0/100.0, 100.0/80.0, 120.0/100.0 |"
        in table
    )


def test_bad_flags_are_refused() -> None:
    for argv in (["--repeats", "0"], ["--batches", "0"], ["--weights", "int3"]):
        with pytest.raises(SystemExit):
            parse_args(argv)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "bench.decode_ab", *args]
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def test_missing_llama_cpp_says_how_to_build_it(tmp_path: Path) -> None:
    proc = _run("--llama-cpp-dir", str(tmp_path / "none"))
    assert proc.returncode == 2
    assert "python -m bench.peers.llama_server build" in proc.stderr


def test_turns_on_the_real_engine_against_a_fake_llama_cpp(tmp_path: Path) -> None:
    fake = fake_llama_cpp.install(tmp_path / "llama.cpp")
    out = tmp_path / "ab.json"
    proc = _run(
        "--batches", "1", "2", "--context", "16", "--steps", "3", "--repeats", "2",
        "--llama-cpp-dir", str(fake.cache_dir), "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["batch"] for r in data["results"]] == [1, 2]
    # The turns alternate: pdserve, llama.cpp, pdserve, llama.cpp (the progress lines).
    turns = [line for line in proc.stderr.splitlines() if line.startswith("[bench.decode_ab]")]
    assert len(turns) == 4
    for r in data["results"]:
        assert len(r["pdserve_ms"]) == len(r["llama_cpp_ms"]) == 2
        assert all(math.isfinite(ms) and ms > 0 for ms in r["pdserve_ms"])
        # The fake's step: STEP_S + PER_SEQ_S x B seconds.
        want = 1000 * (fake_llama_cpp.STEP_S + fake_llama_cpp.PER_SEQ_S * r["batch"])
        assert r["llama_cpp_ms"] == pytest.approx([want, want])
        assert r["ratios"] == pytest.approx([p / want for p in r["pdserve_ms"]])
    assert "| threads | batch | pdserve ms/step (median) |" in proc.stdout

"""The real profiler on the real model with a tiny grid, then a plan from its profile."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.plan.profile import Profile

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_profile_the_real_engine_then_plan(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    measured = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.plan",
            "profile",
            "--out",
            str(out),
            "--threads",
            "1",
            # Wide spreads, so the monotone checks below hold on a busy machine too.
            "--prefill-tokens",
            "16",
            "256",
            "--decode-batches",
            "1",
            "16",
            "--decode-contexts",
            "32",
            "128",
            "--decode-steps",
            "2",
            "--repeats",
            "1",
            "--transfer",
            "shm",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert measured.returncode == 0, measured.stderr
    profile = Profile.load(out)  # validates: axes increase, every time positive and finite
    assert profile.prefill_tokens == (16, 256)
    assert profile.decode_batches == (1, 16)
    assert profile.decode_contexts == (32, 128)
    assert all(s > 0 for s in profile.prefill_s)
    assert profile.prefill_s[1] > profile.prefill_s[0]  # 16x the tokens
    for j in range(len(profile.decode_contexts)):
        assert profile.decode_step_s[1][j] > profile.decode_step_s[0][j]  # batch 16 vs 1
    assert profile.num_layers is not None and profile.num_layers > 0
    assert profile.kv_bytes_per_token is not None
    assert profile.kv_bytes_per_token % (2 * profile.num_layers) == 0
    assert profile.kv_transfer_bytes_per_s is not None and profile.kv_transfer_bytes_per_s > 0
    assert profile.kv_transfer_transport == "shm"
    assert profile.threads == 1
    assert Path(profile.model).is_file()
    assert profile.machine["cpu_count"] >= 1

    # A workload the measured worker can serve: SLOs generous against its own figures.
    itl_ms = 3 * profile.decode_step_s[-1][-1] * 1000
    ttft_ms = 10 * profile.prefill_seconds(100) * 1000
    planned = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.plan",
            "--profile",
            str(out),
            "--rate",
            "0.5",
            "--prompt-tokens",
            "100",
            "--output-tokens",
            "32",
            "--slo-ttft-ms",
            f"{ttft_ms:.3f}",
            "--slo-itl-ms",
            f"{itl_ms:.3f}",
            "--json",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert planned.returncode == 0, planned.stderr
    rec = json.loads(planned.stdout)
    assert rec["verdict"] in ("colocated", "disaggregated")
    assert rec["meets_slos"] is True
    assert rec["disaggregated"]["max_batch"] >= 1

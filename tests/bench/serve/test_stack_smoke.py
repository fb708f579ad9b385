"""``pdserve bench`` end to end: 3 requests against the real local stack (redis-server,
scheduler, one prefill and one decode worker, gateway, real model) started by ``pdserve
up``'s launcher; the JSON must hold 3 successful requests of the asked lengths. Slow: a
2 x 2 multi-turn run on the same stack."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.launcher import Stack, free_port
from services.up import launch, load_up_config

REPO_ROOT = Path(__file__).resolve().parents[3]
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 8


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = load_up_config(
        ["--prefill", "1", "--decode", "1", "--kv-cache-mib", "64",
         "--http-port", str(free_port()), "--grpc-port", str(free_port())], {}
    )  # fmt: skip
    stack = Stack(log_dir=tmp_path_factory.mktemp("stack"))
    try:
        yield launch(args, stack)["http"]
    finally:
        stack.stop()


def test_pdserve_bench_against_the_real_stack(gateway_url: str, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, "-m", "pdserve.cli", "bench", "--base-url", gateway_url,
        "--workload", "fixed", "--num-requests", "3", "--prompt-tokens", str(PROMPT_TOKENS),
        "--output-tokens", str(OUTPUT_TOKENS), "--arrival", "concurrency", "--concurrency", "3",
        "--timeout-s", "120", "--json", str(out), "--no-progress",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    records = data["records"]
    assert len(records) == 3
    for r in records:
        assert r["error"] is None and r["status"] == 200, r
        assert r["prompt_tokens"] == PROMPT_TOKENS
        assert r["completion_tokens"] == OUTPUT_TOKENS  # ignore_eos: the asked length
        assert r["finish_reason"] == "length"
        times = r["token_times_s"]
        assert 1 <= len(times) <= OUTPUT_TOKENS
        assert 0 <= r["send_s"] < times[0]
        assert times == sorted(times) and times[-1] <= r["end_s"]
    summary = data["summaries"]["all"]
    assert (summary["num_ok"], summary["num_failed"]) == (3, 0)
    assert summary["total_output_tokens"] == 3 * OUTPUT_TOKENS
    assert summary["ttft_ms"]["p50"] > 0 and summary["output_throughput"] > 0
    assert "| all | 3 | 0 |" in proc.stdout


@pytest.mark.slow
def test_a_multi_turn_run_through_the_real_stack(gateway_url: str, tmp_path: Path) -> None:
    """Each turn carries the answer before it; pdserve's object names the workers and the
    KV bytes moved (none for a prompt the decode worker prefilled itself)."""
    out = tmp_path / "multi.json"
    cmd = [
        sys.executable, "-m", "pdserve.cli", "bench", "--base-url", gateway_url,
        "--workload", "multi-turn", "--sessions", "2", "--turns", "2", "--system-tokens", "40",
        "--user-tokens", "16", "--output-tokens", "6", "--concurrency", "2",
        "--timeout-s", "120", "--json", str(out), "--no-progress",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = json.loads(out.read_text())["records"]
    assert [(r["session"], r["turn"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in records:
        assert r["error"] is None and r["output_text"], r
        assert r["decode_worker_id"] == "decode-0" and r["cached_tokens"] is not None
        assert r["prefill_worker_id"] in ("prefill-0", "")
        assert (r["kv_transfer_bytes"] > 0) == (r["prefill_worker_id"] == "prefill-0"), r
    for first, second in (records[0:2], records[2:4]):
        # the second turn's prompt holds the first's and its answer, then a new message
        grown = first["prompt_tokens"] + first["completion_tokens"] + 16
        assert second["prompt_tokens"] >= grown
    assert "prefix reuse:" in proc.stdout and "| later-turn | 2 |" in proc.stdout


@pytest.mark.slow
def test_a_trace_replay_through_the_real_stack(gateway_url: str, tmp_path: Path) -> None:
    """A later turn whose hash ids extend an earlier turn's comes back with the shared
    blocks cached; a request of its own shares nothing."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 1024, "output_length": 64, "hash_ids": [1, 2]}\n'
        '{"timestamp": 2000, "input_length": 1536, "output_length": 64, "hash_ids": [1, 2, 3]}\n'
        '{"timestamp": 2100, "input_length": 300, "output_length": 64, "hash_ids": [9]}\n'
    )
    out = tmp_path / "trace.json"
    cmd = [
        sys.executable, "-m", "pdserve.cli", "bench", "--base-url", gateway_url,
        "--workload", "trace", "--trace", str(trace), "--timeout-s", "120",
        "--json", str(out), "--no-progress",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = json.loads(out.read_text())["records"]
    assert [r["error"] for r in records] == [None] * 3, records
    assert [r["prompt_tokens"] for r in records] == [64, 96, 19]  # lengths / 16
    assert [r["completion_tokens"] for r in records] == [4, 4, 4]
    _, later, alone = records
    assert 0 < later["cached_tokens"] <= 64 and alone["cached_tokens"] == 0, records
    assert "cached share of prompt tokens: " in proc.stdout

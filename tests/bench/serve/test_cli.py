"""``pdserve bench`` flags, and a whole CLI run (JSON, table, plots) against a fake server."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web

from bench.serve.arrival import Concurrency, FixedRate, Poisson, Schedule
from bench.serve.cli import (
    arrival_from_args,
    endpoint_from_args,
    ignore_eos_from_args,
    run_bench,
)
from bench.serve.result import BenchResult
from pdserve.cli import build_parser
from tests.bench.serve.fake_server import completion_chunk, make_app, sse, start_stream, usage_chunk

REPO_ROOT = Path(__file__).resolve().parents[3]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *argv])


def test_pdserve_bench_is_registered_with_its_defaults() -> None:
    args = parse()
    assert args.func.__name__ == "run_bench"
    assert (args.workload, endpoint_from_args(args), args.prompt_format) == (
        "fixed", "completions", "ids"
    )  # fmt: skip
    assert ignore_eos_from_args(args) is True
    assert ignore_eos_from_args(parse("--no-ignore-eos")) is False
    assert (args.streams, args.stream_output_tokens, args.long_prompt_tokens) == (8, 256, 1024)


def test_arrival_from_flags() -> None:
    assert arrival_from_args(parse("--rate", "3", "--seed", "9")) == Poisson(3.0, 9)
    assert arrival_from_args(parse("--arrival", "rate", "--rate", "2")) == FixedRate(2.0)
    assert arrival_from_args(parse("--arrival", "concurrency", "--concurrency", "5")) == (
        Concurrency(5)
    )
    assert arrival_from_args(parse("--workload", "interference")) == Schedule()
    with pytest.raises(ValueError):
        arrival_from_args(parse("--workload", "interference", "--arrival", "rate"))
    assert run_bench(parse("--workload", "interference", "--arrival", "rate")) == 2


def test_conversations_are_chat_closed_loop_and_keep_the_models_ends() -> None:
    for workload in ("multi-turn", "shared-prefix"):
        args = parse("--workload", workload, "--concurrency", "3")
        assert endpoint_from_args(args) == "chat" and ignore_eos_from_args(args) is False
        assert arrival_from_args(args) == Concurrency(3)
        assert ignore_eos_from_args(parse("--workload", workload, "--ignore-eos")) is True
        assert arrival_from_args(parse("--workload", workload, "--arrival", "concurrency"))
        with pytest.raises(ValueError, match="drop --endpoint"):
            endpoint_from_args(parse("--workload", workload, "--endpoint", "completions"))
        with pytest.raises(ValueError, match="drop --arrival"):
            arrival_from_args(parse("--workload", workload, "--arrival", "poisson"))
        assert run_bench(parse("--workload", workload, "--arrival", "rate")) == 2
    args = parse("--workload", "multi-turn")
    assert (args.sessions, args.turns, args.system_tokens, args.user_tokens) == (8, 4, 512, 64)


def test_module_help_states_the_goodput_rule() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.serve", "--help"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "every one of its" in out.stdout and "--slo-itl-ms" in out.stdout
    assert "multi-turn" in out.stdout and "--system-prompts" in out.stdout


def test_cli_run_writes_json_table_and_plots(
    threaded_server: Callable[[web.Application], str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    prompts: list[list[int]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompts.append(body["prompt"])
        resp = await start_stream(request)
        for _ in range(body["max_tokens"]):
            await resp.write(sse(completion_chunk("w")))
        await resp.write(sse(usage_chunk(len(body["prompt"]), body["max_tokens"])))
        await resp.write(sse("[DONE]"))
        return resp

    url = threaded_server(make_app(handler))
    out_json = tmp_path / "bench.json"
    rc = run_bench(parse(
        "--base-url", url, "--workload", "interference", "--streams", "2",
        "--stream-output-tokens", "5", "--long-prompt-tokens", "64", "--long-start-s", "0.05",
        "--long-every-s", "0.05", "--long-count", "2", "--slo-ttft-ms", "10000",
        "--json", str(out_json), "--plot-dir", str(tmp_path / "plots"), "--no-progress",
    ))  # fmt: skip
    assert rc == 0
    data = json.loads(out_json.read_text())
    result = BenchResult.from_dict(data)
    assert [r.tag for r in result.records] == ["stream", "stream", "long", "long"]
    assert all(r.ok for r in result.records)
    assert [len(p) for p in prompts] == [32, 32, 64, 64]
    assert [r.completion_tokens for r in result.records] == [5, 5, 16, 16]
    assert set(data["summaries"]) == {"all", "stream", "long"}
    assert data["summaries"]["all"]["num_good"] == 4
    assert data["config"]["workload"] == "interference" and data["config"]["long_count"] == 2
    assert (tmp_path / "plots" / "itl_over_time.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "plots" / "latency_cdf.png").read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "| all | 4 | 0 |" in printed and "| long | 2 | 0 |" in printed


def test_a_multi_turn_run_reports_reuse(
    threaded_server: Callable[[web.Application], str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def chat(request: web.Request) -> web.StreamResponse:
        messages = (await request.json())["messages"]
        resp = await start_stream(request)
        await resp.write(sse({"choices": [{"delta": {"content": "ok"}}]}))
        await resp.write(sse({"choices": [{"delta": {}, "finish_reason": "stop"}]}))
        turn = len(messages) // 2 - 1  # system, then a user and an answer per turn before
        usage = {
            "prompt_tokens": 100,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 80 if turn else 0},
        }
        ext = {"kv_transfer_bytes": 1 << 20, "prefill_worker_id": f"prefill-{turn % 2}",
               "decode_worker_id": "decode-0"}  # fmt: skip
        await resp.write(sse({"choices": [], "usage": usage, "pdserve": ext}))
        await resp.write(sse("[DONE]"))
        return resp

    url = threaded_server(make_app(None, chat))
    out_json = tmp_path / "bench.json"
    rc = run_bench(parse(
        "--base-url", url, "--workload", "multi-turn", "--sessions", "2", "--turns", "3",
        "--system-tokens", "20", "--user-tokens", "8", "--output-tokens", "4",
        "--json", str(out_json), "--no-progress",
    ))  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "workload multi-turn: 6 requests" in printed
    assert "| later-turn | 4 | 400 | 320 | 80 | 80.0% | 1.00 | 1.00 | 1.00 |" in printed
    assert "| prefill-1 | 2 | 200 | 160 | 40 | 80.0% | 2.00 |" in printed
    data = json.loads(out_json.read_text())
    assert data["reuse"]["all"]["total"]["cached_tokens"] == 320
    assert data["config"]["turns"] == 3 and data["config"]["num_sessions"] == 2
    assert [(r["session"], r["turn"]) for r in data["records"]] == [
        (s, t) for s in range(2) for t in range(3)
    ]

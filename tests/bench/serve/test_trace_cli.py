"""``pdserve bench --workload trace``: its flags, bad traces as exit 2, and a whole replay
against a fake server with a prefix cache (goodput, the largest gap, the cached share)."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web

from bench.serve.arrival import Schedule
from bench.serve.cli import arrival_from_args, endpoint_from_args, run_bench, slo_from_args
from bench.serve.metrics import Slo
from pdserve.cli import build_parser
from tests.bench.serve.fake_server import completion_chunk, make_app, sse, start_stream

# divisor 64: blocks of 8 tokens
TRACE = [
    {"timestamp": 0, "input_length": 1024, "output_length": 128, "hash_ids": [1, 2]},
    {"timestamp": 100, "input_length": 1536, "output_length": 192, "hash_ids": [1, 2, 3]},
    {"timestamp": 200, "input_length": 768, "output_length": 64, "hash_ids": [4, 5]},
    {"timestamp": 300, "input_length": 1280, "output_length": 256, "hash_ids": [4, 5, 6]},
    {"timestamp": 400, "input_length": 1024, "output_length": 64, "hash_ids": [1, 7]},
    {"timestamp": 450, "input_length": 300, "output_length": 10, "hash_ids": [], "x": "y"},
]
PROMPTS = [16, 24, 12, 20, 16, 5]  # input / 64, rounded
# what an earlier prompt sent: 16 (blocks 1, 2), 8 + 4 (block 5 was half sent), 8 (block 1)
REUSABLE = 16 + 12 + 8
SLOW = 20  # the fake server streams this prompt length's tokens 0.25 s apart
SERVER_BLOCK = 8  # the fake server caches whole blocks of this many tokens


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *argv])


def write(path: Path, lines: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_trace_flags_and_their_defaults(tmp_path: Path) -> None:
    trace = str(write(tmp_path / "t.jsonl", TRACE))
    args = parse("--workload", "trace", "--trace", trace)
    assert (args.trace_token_divisor, args.trace_time_scale, args.trace_sample) == (16, 1.0, None)
    assert (args.trace_max_requests, args.trace_duration_s) == (1000, 600.0)
    assert endpoint_from_args(args) == "completions" and arrival_from_args(args) == Schedule()
    assert slo_from_args(args) == Slo(ttft_ms=2000.0, itl_ms=200.0)
    assert slo_from_args(parse("--workload", "trace", "--slo-itl-ms", "50")) == Slo(2000.0, 50.0)
    assert slo_from_args(parse("--workload", "fixed")) is None
    for extra in (("--arrival", "poisson"), ("--endpoint", "chat"),
                  ("--trace-token-divisor", "3"), ("--trace-sample", "0")):  # fmt: skip
        assert run_bench(parse("--workload", "trace", "--trace", trace, *extra)) == 2


def test_bad_traces_and_flags_exit_2_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(TRACE[0]) + "\n" + '{"timestamp": 5, "input_length": "many"}\n')
    assert run_bench(parse("--workload", "trace", "--trace", str(bad))) == 2
    assert f"{bad}:2: 'input_length' must be an integer" in capsys.readouterr().err
    assert run_bench(parse("--workload", "trace", "--trace", str(tmp_path / "no.jsonl"))) == 2
    assert "cannot read the trace" in capsys.readouterr().err
    assert run_bench(parse("--workload", "trace")) == 2
    assert run_bench(parse("--workload", "fixed", "--trace", str(bad))) == 2
    assert "go together" in capsys.readouterr().err


def test_a_replay_is_open_loop_and_reports_goodput_and_cached_share(
    threaded_server: Callable[[web.Application], str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen: list[list[int]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["prompt"]
        # a prefix cache of whole blocks: the longest prefix an earlier prompt had, floored
        shared = max((_common(prompt, p) for p in seen), default=0)
        seen.append(prompt)
        resp = await start_stream(request)
        for i in range(body["max_tokens"]):
            if i and len(prompt) == SLOW:
                await asyncio.sleep(0.25)
            await resp.write(sse(completion_chunk("w")))
        cached = shared // SERVER_BLOCK * SERVER_BLOCK
        usage = {"prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"],
                 "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
        await resp.write(sse({"choices": [], "usage": usage}))
        await resp.write(sse("[DONE]"))
        return resp

    url = threaded_server(make_app(handler))
    out = tmp_path / "run.json"
    trace = write(tmp_path / "t.jsonl", TRACE)
    rc = run_bench(parse(
        "--base-url", url, "--workload", "trace", "--trace", str(trace),
        "--trace-token-divisor", "64", "--trace-time-scale", "0.5", "--json", str(out),
        "--no-progress",
    ))  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    records = data["records"]
    assert [len(p) for p in seen] == PROMPTS  # in trace order, exact lengths
    assert [r["prompt_tokens"] for r in records] == PROMPTS
    assert [r["completion_tokens"] for r in records] == [2, 3, 1, 4, 1, 1]
    assert [r["scheduled_s"] for r in records] == pytest.approx([0, 0.05, 0.1, 0.15, 0.2, 0.225])
    slow = records[3]
    assert records[4]["send_s"] < slow["end_s"]  # sent on time, not after the slow one ended
    assert [(r["session"], r["turn"]) for r in records] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (2, 0),
    ]  # fmt: skip
    # goodput under the trace's default SLOs: the slow request's gaps break ITL <= 200 ms
    summary = data["summaries"]["all"]
    assert summary["slo"] == {"ttft_ms": 2000.0, "itl_ms": 200.0}
    assert (summary["num_good"], summary["good_fraction"]) == (5, 5 / 6)
    assert summary["itl_ms"]["max"] >= 250.0
    assert set(data["summaries"]) == {"all", "new-prefix", "seen-prefix"}
    assert data["summaries"]["seen-prefix"]["num_requests"] == 3
    # cached share: what the server reported (whole blocks) beside the trace's ceiling
    cached = 16 + 8 + 8  # block 5 was half sent: the server's block is not whole
    reuse = data["reuse"]["all"]["total"]
    assert (reuse["cached_tokens"], reuse["prompt_tokens"]) == (cached, sum(PROMPTS))
    stats = data["config"]["trace_stats"]
    assert (stats["reusable_tokens"], stats["prompt_tokens"]) == (REUSABLE, sum(PROMPTS))
    assert stats["reusable_share"] == REUSABLE / sum(PROMPTS)
    assert data["config"]["workload"] == "trace" and data["config"]["token_divisor"] == 64
    printed = capsys.readouterr().out
    assert "good: 5 of 6 (83.3%) with TTFT <= 2000 ms and every ITL <= 200 ms" in printed
    assert f"cached share of prompt tokens: 34.4% ({cached} of 93, as the server reported); " \
           "the trace allows at most 38.7%" in printed  # fmt: skip
    assert "6 requests of 3 conversations" in printed


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n

"""The overload workload: its verdict (pure), and a run of ``pdserve bench --workload
overload`` against a fake server with a cap of two streams that refuses the rest."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web

from bench.cli import add_commands
from bench.serve.cli import run_bench
from bench.serve.overload import Phase, verdict
from bench.serve.result import RequestRecord
from tests.bench.serve.fake_server import completion_chunk, make_app, sse, start_stream, usage_chunk


def _rec(tag: str, status: int, send: float, times: tuple[float, ...], end: float) -> RequestRecord:
    error = None if status == 200 else f"HTTP {status}"
    return RequestRecord(0, tag, send, end, times, 1, len(times), len(times), status, error)


def _phases(busy_gap: float, refusal_s: float, huge_status: int) -> list[Phase]:
    quiet = Phase("quiet", (_rec("stream", 200, 0.0, (0.1, 0.2, 0.3, 0.4), 0.4),))
    busy = Phase("overload", (
        _rec("stream", 200, 1.0, tuple(1.1 + i * busy_gap for i in range(4)), 2.0),
        _rec("flood", 429, 1.0, (), 1.0 + refusal_s),
        _rec("huge", huge_status, 1.0, (), 1.2),
    ))  # fmt: skip
    after = Phase("after", (_rec("stream", 200, 3.0, (3.1, 3.2), 3.2),))
    return [quiet, busy, after]


@pytest.mark.parametrize(
    ("busy_gap", "refusal_s", "huge_status", "ok", "needle"),
    [
        (0.2, 0.01, 400, True, "2.00x the quiet P50"),
        (0.4, 0.01, 400, False, "4.00x the quiet P50"),  # ITL P99 past 3x
        (0.1, 2.0, 400, False, "1 of them after more than 1 s"),  # a late refusal
        (0.1, 0.01, 200, False, "huge prompts: 200 in 200 ms"),  # a huge prompt served
    ],
)
def test_verdict(busy_gap, refusal_s, huge_status, ok, needle) -> None:
    passed, lines = verdict(_phases(busy_gap, refusal_s, huge_status))
    assert passed is ok
    assert any(needle in line for line in lines), lines
    assert lines[-1] == f"verdict: {'PASS' if ok else 'FAIL'}"


def test_pdserve_bench_offers_the_overload_workload() -> None:
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    args = parser.parse_args(["bench", "--workload", "overload", "--flood", "5"])
    assert (args.workload, args.flood, args.stalled, args.huge, args.huge_mib) == (
        "overload", 5, 8, 3, 3.0,
    )  # fmt: skip


def test_an_overload_run_against_a_capped_server(
    threaded_server: Callable[[web.Application], str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    running = 0

    async def completions(request: web.Request) -> web.StreamResponse:
        nonlocal running
        body = await request.json()
        if running >= 2:
            return web.json_response({"error": {"message": "busy"}}, status=429)
        running += 1
        try:
            resp = await start_stream(request)
            for _ in range(body["max_tokens"]):
                await asyncio.sleep(0.005)
                await resp.write(sse(completion_chunk("w")))
            await resp.write(sse(usage_chunk(len(body["prompt"]), body["max_tokens"])))
            await resp.write(sse("[DONE]"))
            return resp
        finally:
            running -= 1

    async def chat(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "too long"}}, status=400)

    url = threaded_server(make_app(completions, chat))
    out = tmp_path / "overload.json"
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    args = parser.parse_args([
        "bench", "--base-url", url, "--workload", "overload", "--streams", "2", "--flood", "3",
        "--stalled", "1", "--huge", "1", "--huge-mib", "0.1", "--quiet-s", "0.3",
        "--overload-s", "1.5", "--prompt-tokens", "8", "--output-tokens", "4",
        "--json", str(out),
    ])  # fmt: skip
    rc = run_bench(args)
    printed = capsys.readouterr().out
    assert "verdict: " in printed and "huge prompts: 400 in" in printed
    data = json.loads(out.read_text())
    busy = data["phases"]["overload"]
    assert any(r["status"] == 429 for r in busy)  # the flood met the cap
    assert [r["error"] for r in data["phases"]["after"]] == [None, None]
    assert rc in (0, 1)  # PASS or FAIL is a timing verdict: not asserted on a loaded machine

"""The streaming client and the runner against tiny aiohttp servers started here: known SSE
chunks in, records out; error statuses, error events, truncated and stalled streams are
recorded as failures and never hang the run."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web

from bench.serve.arrival import Concurrency, FixedRate, Schedule
from bench.serve.client import ClientOptions, SseEvent, parse_sse_line, request_body
from bench.serve.result import BenchResult
from bench.serve.runner import root_url, run_benchmark
from bench.serve.workload import ChatMessage, RequestSpec
from tests.bench.serve.fake_server import (
    MODEL,
    Handler,
    Serve,
    completion_chunk,
    sse,
    start_stream,
    usage_chunk,
)

DEADLINE_S = 20.0  # no test here may take longer: a hang fails instead of blocking


def spec(tag: str = "request", offset: float | None = None, while_tag: str | None = None,
         output: int = 4) -> RequestSpec:  # fmt: skip
    return RequestSpec((11, 12, 13), " a b c", output, tag, offset, while_tag)


async def run(url: str, specs: list[RequestSpec], **kw: Any) -> BenchResult:
    kw.setdefault("timeout_s", 5.0)
    async with asyncio.timeout(DEADLINE_S):
        return await run_benchmark(url, specs, progress=False, **kw)


def recording_stream(bodies: list[dict[str, Any]], texts: list[str], usage: int | None) -> Handler:
    """A completions handler streaming ``texts`` (one chunk each), then usage and [DONE]."""

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        resp = await start_stream(request)
        await resp.write(b": keep-alive comment\n\n")
        for i, text in enumerate(texts):
            await asyncio.sleep(0.01)
            finish = "length" if i == len(texts) - 1 else None
            await resp.write(sse(completion_chunk(text, finish)))
        if usage is not None:
            await resp.write(sse(usage_chunk(len(body["prompt"]), usage)))
        await resp.write(sse("[DONE]"))
        return resp

    return handler


def test_parse_sse_line() -> None:
    assert parse_sse_line(b"\n") is None
    assert parse_sse_line(b": ping\n") is None
    assert parse_sse_line(b"event: x\n") is None
    assert parse_sse_line(b"data: [DONE]\n") == SseEvent(done=True)
    ev = parse_sse_line(b'data: {"choices":[{"text":"hi","finish_reason":null}]}\n')
    assert ev is not None and ev.text == "hi" and ev.usage is None and ev.error is None
    ev = parse_sse_line('data:{"choices":[{"delta":{"content":"yo"},"finish_reason":"stop"}]}')
    assert ev is not None and ev.text == "yo" and ev.finish_reason == "stop" and ev.id == ""
    ev = parse_sse_line('data: {"id":"chatcmpl-7","choices":[{"delta":{"content":"a"}}]}')
    assert ev is not None and ev.id == "chatcmpl-7"
    ev = parse_sse_line('data: {"choices":[{"delta":{"role":"assistant","content":""}}]}')
    assert ev is not None and ev.text == ""
    ev = parse_sse_line('data: {"choices":[],"usage":{"completion_tokens":3}}')
    assert ev is not None and ev.text == "" and ev.usage == {"completion_tokens": 3}
    ev = parse_sse_line('data: {"error":{"message":"KV lost","type":"server_error"}}')
    assert ev is not None and ev.error == "KV lost"
    ev = parse_sse_line("data: {not json")
    assert ev is not None and ev.error is not None and "not JSON" in ev.error


def test_usage_details_and_the_pdserve_object_are_read() -> None:
    ext = {"kv_transfer_bytes": 7, "prefill_worker_id": "p", "decode_worker_id": "d"}
    line = json.dumps({"choices": [], "usage": {"prompt_tokens": 3}, "pdserve": ext})
    ev = parse_sse_line("data: " + line)
    assert ev is not None and ev.pdserve == ext and ev.usage == {"prompt_tokens": 3}
    ev = parse_sse_line('data: {"choices":[],"pdserve":"odd"}')
    assert ev is not None and ev.pdserve is None


def test_a_conversation_sends_its_messages() -> None:
    conv = RequestSpec((), "q2", 4, messages=(ChatMessage("system", "S"), ChatMessage("user", "q1"),
                       ChatMessage("assistant", "a1"), ChatMessage("user", "q2")))  # fmt: skip
    body = request_body(conv, "m", ClientOptions(endpoint="chat", ignore_eos=False))
    assert body["messages"] == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"},
    ]  # fmt: skip


def test_request_body_and_root_url() -> None:
    s = spec(output=9)
    body = request_body(s, "m", ClientOptions())
    assert body == {
        "model": "m", "max_tokens": 9, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True, "prompt": [11, 12, 13],
    }  # fmt: skip
    text = request_body(s, "m", ClientOptions(prompt_format="text", ignore_eos=False))
    assert text["prompt"] == " a b c" and "ignore_eos" not in text
    chat = request_body(s, "m", ClientOptions(endpoint="chat"))
    assert chat["messages"] == [{"role": "user", "content": " a b c"}] and "prompt" not in chat
    assert root_url("http://h:1/v1/") == root_url("http://h:1/") == "http://h:1"


async def test_stream_is_timed_chunk_by_chunk(serve: Serve) -> None:
    bodies: list[dict[str, Any]] = []
    # 4 chunks, one with no text (not a token event); usage reports 5 tokens
    url = await serve(recording_stream(bodies, ["a", "b", "", "c"], usage=5))
    result = await run(url + "/v1", [spec(output=5)])
    assert bodies[0]["model"] == MODEL  # asked /v1/models
    assert bodies[0]["prompt"] == [11, 12, 13] and bodies[0]["ignore_eos"] is True
    (r,) = result.records
    assert r.ok and r.status == 200 and r.error is None
    assert len(r.token_times_s) == 3
    assert r.completion_tokens == 5 and r.prompt_tokens == 3  # from usage
    assert r.cached_tokens is None and r.kv_transfer_bytes is None  # usage said neither
    assert r.output_text is None  # kept only for conversations
    assert r.finish_reason == "length"
    assert 0 <= r.send_s < r.token_times_s[0] <= r.token_times_s[1] <= r.token_times_s[2]
    assert r.token_times_s[2] <= r.end_s == result.duration_s
    assert result.config["model"] == MODEL and result.config["dropped"] == 0


async def test_counts_fall_back_without_usage(serve: Serve) -> None:
    url = await serve(recording_stream([], ["x", "y"], usage=None))
    result = await run(url, [spec(output=2)], model="named")
    (r,) = result.records
    assert r.ok and r.completion_tokens == 2 and r.prompt_tokens == 3
    assert result.config["model"] == "named"


async def test_chat_role_chunk_is_not_a_token(serve: Serve) -> None:
    seen: list[dict[str, Any]] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        resp = await start_stream(request)
        for delta in ({"role": "assistant", "content": ""}, {"content": "Hi"}, {"content": "!"}):
            await resp.write(sse({"choices": [{"delta": delta, "finish_reason": None}]}))
        await resp.write(sse({"choices": [{"delta": {}, "finish_reason": "length"}]}))
        await resp.write(sse(usage_chunk(30, 2)))
        await resp.write(sse("[DONE]"))
        return resp

    url = await serve(recording_stream([], [], None), chat)
    result = await run(url, [spec(output=2)], endpoint="chat")
    (r,) = result.records
    assert r.ok and len(r.token_times_s) == 2 and r.completion_tokens == 2
    assert r.prompt_tokens == 30 and r.finish_reason == "length"
    assert seen[0]["messages"] == [{"role": "user", "content": " a b c"}]


async def test_failures_are_recorded_and_never_hang(serve: Serve) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        mode = (await request.json())["max_tokens"]
        if mode == 1:  # an error status with an OpenAI error body
            return web.json_response({"error": {"message": "overloaded"}}, status=429)
        resp = await start_stream(request)
        await resp.write(sse(completion_chunk("t")))
        if mode == 2:  # an error event after the stream started
            await resp.write(sse({"error": {"message": "decode worker died"}}))
        elif mode == 3:  # stalls far past the client's deadline
            await asyncio.sleep(60)
        elif mode == 4:  # ends without [DONE]
            pass
        else:
            await resp.write(sse("[DONE]"))
        return resp

    url = await serve(handler)
    specs = [spec(output=m) for m in (1, 2, 3, 4, 5)]
    result = await run(url, specs, model="m", timeout_s=1.0)
    r429, rerr, rstall, rtrunc, rok = result.records
    assert r429.status == 429 and r429.error is not None and "overloaded" in r429.error
    assert rerr.status == 200 and rerr.error == "stream error: decode worker died"
    assert rstall.error == "timed out after 1 s" and len(rstall.token_times_s) == 1
    assert rtrunc.error == "the stream ended before [DONE]"
    assert rok.ok and rok.completion_tokens == 1
    assert [r.index for r in result.records] == [0, 1, 2, 3, 4]


async def test_unreachable_server_is_a_failed_record() -> None:
    from services.launcher import free_port

    result = await run(f"http://127.0.0.1:{free_port()}", [spec()], model="m")
    (r,) = result.records
    assert not r.ok and r.status == 0 and r.error


async def test_closed_loop_keeps_the_concurrency(serve: Serve) -> None:
    state = {"in_flight": 0, "max": 0}
    two_in = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        state["in_flight"] += 1
        state["max"] = max(state["max"], state["in_flight"])
        if state["in_flight"] >= 2:
            two_in.set()
        try:  # hold the first request until a second is in flight (or 2 s pass)
            async with asyncio.timeout(2.0):
                await two_in.wait()
        except TimeoutError:
            pass
        resp = await start_stream(request)
        await resp.write(sse(completion_chunk("t")))
        await resp.write(sse("[DONE]"))
        state["in_flight"] -= 1
        return resp

    url = await serve(handler)
    result = await run(url, [spec() for _ in range(6)], model="m", arrival=Concurrency(2))
    assert len(result.records) == 6 and all(r.ok for r in result.records)
    assert state["max"] == 2
    assert result.config["arrival"] == {"kind": "concurrency", "limit": 2}


async def test_open_loop_offsets_and_schedule(serve: Serve) -> None:
    url = await serve(recording_stream([], ["t"], usage=1))
    fixed = await run(url, [spec() for _ in range(3)], model="m", arrival=FixedRate(20.0))
    assert [r.scheduled_s for r in fixed.records] == pytest.approx([0.0, 0.05, 0.1])
    assert all(r.send_s >= (r.scheduled_s or 0.0) for r in fixed.records)
    sched = await run(url, [spec(offset=0.3), spec(offset=0.0)], model="m", arrival=Schedule())
    late, early = sched.records
    assert (late.scheduled_s, early.scheduled_s) == (0.3, 0.0)
    assert late.send_s >= 0.3 and early.send_s < late.send_s


async def test_while_tag_requests_are_dropped_once_the_tag_is_done(serve: Serve) -> None:
    url = await serve(recording_stream([], ["a", "b"], usage=2))
    specs = [
        spec("stream", 0.0),
        spec("long", 0.0, while_tag="stream"),  # sent: the stream is still running
        spec("long", 30.0, while_tag="stream"),  # dropped at once when the stream ends
        spec("long", 60.0, while_tag="stream"),
    ]
    result = await run(url, specs, model="m")
    assert [(r.index, r.tag) for r in result.records] == [(0, "stream"), (1, "long")]
    assert result.config["dropped"] == 2
    assert json.loads(json.dumps(result.to_dict()))["config"]["dropped"] == 2


async def test_a_first_token_that_ends_the_request_is_timed(serve: Serve) -> None:
    """EOS as the first token: no text ever comes, and the chunk that finishes the choice
    is when the token arrived (the request has a TTFT)."""

    async def chat(request: web.Request) -> web.StreamResponse:
        resp = await start_stream(request)
        await resp.write(sse({"choices": [{"delta": {"role": "assistant", "content": ""},
                                            "finish_reason": None}]}))  # fmt: skip
        await asyncio.sleep(0.05)
        await resp.write(sse({"choices": [{"delta": {}, "finish_reason": "stop"}]}))
        await resp.write(sse(usage_chunk(30, 1)))
        await resp.write(sse("[DONE]"))
        return resp

    url = await serve(recording_stream([], [], None), chat)
    result = await run(url, [spec(output=2)], endpoint="chat")
    (r,) = result.records
    assert r.ok and r.completion_tokens == 1 and r.finish_reason == "stop"
    assert len(r.token_times_s) == 1 and r.token_times_s[0] >= r.send_s + 0.04

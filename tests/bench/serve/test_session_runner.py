"""Conversations against a tiny chat server started here: each turn is sent only after the
turn before it was answered, with that answer in its messages; sessions run side by side up
to the concurrency; a failed turn ends its session; usage's cached tokens and the
``"pdserve"`` object land in the records."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from bench.serve.result import BenchResult
from bench.serve.session_runner import run_sessions
from bench.serve.sessions import Session
from tests.bench.serve.fake_server import Handler, Serve, sse, start_stream

DEADLINE_S = 20.0


def session(i: int, *users: str) -> Session:
    return Session(index=i, system_index=0, system="SYS", user_turns=users, output_tokens=3)


def chat_server(seen: list[list[dict[str, str]]], state: dict[str, int]) -> Handler:
    """Answers ``<last user message>!`` in two chunks, then usage (cached = 2 tokens a
    message before the last) and pdserve's object; 500 for a message that says FAIL."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        messages = body["messages"]
        seen.append(messages)
        state["in_flight"] += 1
        state["max"] = max(state["max"], state["in_flight"])
        try:
            await asyncio.sleep(0.05)
            last = messages[-1]["content"]
            if last == "FAIL":
                return web.json_response({"error": {"message": "boom"}}, status=500)
            resp = await start_stream(request)
            for part in (last, "!"):
                await resp.write(sse({"choices": [{"delta": {"content": part}}]}))
            await resp.write(sse({"choices": [{"delta": {}, "finish_reason": "stop"}]}))
            usage = {
                "prompt_tokens": 10 * len(messages),
                "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 2 * (len(messages) - 1)},
            }
            ext = {"kv_transfer_bytes": 100 * len(messages), "prefill_worker_id": "prefill-1",
                   "decode_worker_id": "decode-0"}  # fmt: skip
            await resp.write(sse({"choices": [], "usage": usage, "pdserve": ext}))
            await resp.write(sse("[DONE]"))
            return resp
        finally:
            state["in_flight"] -= 1

    return chat


async def run(url: str, sessions: list[Session], **kw: Any) -> BenchResult:
    async with asyncio.timeout(DEADLINE_S):
        return await run_sessions(url, sessions, progress=False, timeout_s=5.0, **kw)


async def test_turns_carry_the_answers_before_them(serve: Serve) -> None:
    seen: list[list[dict[str, str]]] = []
    state = {"in_flight": 0, "max": 0}
    url = await serve(None, chat_server(seen, state))
    sessions = [session(i, f"s{i}a", f"s{i}b", f"s{i}c") for i in range(3)]
    result = await run(url, sessions, concurrency=2)
    assert [(r.session, r.turn, r.index) for r in result.records] == [
        (s, t, 3 * s + t) for s in range(3) for t in range(3)
    ]
    assert all(r.ok for r in result.records) and result.config["dropped"] == 0
    third = next(m for m in seen if m[-1]["content"] == "s1c")
    assert third == [
        {"role": "system", "content": "SYS"},
        {"role": "user", "content": "s1a"}, {"role": "assistant", "content": "s1a!"},
        {"role": "user", "content": "s1b"}, {"role": "assistant", "content": "s1b!"},
        {"role": "user", "content": "s1c"},
    ]  # fmt: skip
    assert state["max"] == 2  # two sessions at once, one turn each
    r = result.records[5]  # session 1, turn 2: 6 messages
    assert (r.prompt_tokens, r.cached_tokens, r.completion_tokens) == (60, 10, 2)
    assert (r.kv_transfer_bytes, r.prefill_worker_id, r.decode_worker_id) == (
        600, "prefill-1", "decode-0"
    )  # fmt: skip
    assert r.output_text == "s1c!" and r.tag == "later-turn"
    assert result.records[0].tag == "first-turn"
    assert result.config["arrival"] == {"kind": "concurrency", "limit": 2, "of": "sessions"}
    assert result.config["model"] == "fake-model" and result.config["endpoint"] == "chat"
    assert "ignore_eos" not in json.dumps(seen)  # answers end where the model ends them


async def test_a_failed_turn_ends_its_session_only(serve: Serve) -> None:
    seen: list[list[dict[str, str]]] = []
    url = await serve(None, chat_server(seen, {"in_flight": 0, "max": 0}))
    sessions = [session(0, "a", "FAIL", "never"), session(1, "x", "y")]
    result = await run(url, sessions, concurrency=1, model="m")
    assert [(r.session, r.turn, r.ok) for r in result.records] == [
        (0, 0, True), (0, 1, False), (1, 0, True), (1, 1, True)
    ]  # fmt: skip
    assert result.records[1].error is not None and "boom" in result.records[1].error
    assert result.config["dropped"] == 1 and result.config["num_requests"] == 5
    assert [r.index for r in result.records] == [0, 1, 3, 4]
    assert all(m[-1]["content"] != "never" for m in seen)


async def test_rounds_send_every_sessions_turn_before_any_next_turn(serve: Serve) -> None:
    seen: list[list[dict[str, str]]] = []
    state = {"in_flight": 0, "max": 0}
    url = await serve(None, chat_server(seen, state))
    sessions = [session(0, "a0", "a1", "a2"), session(1, "b0", "FAIL", "never"),
                session(2, "c0", "c1")]  # fmt: skip
    result = await run(url, sessions, concurrency=2, rounds=True)
    order = [m[-1]["content"] for m in seen]
    # round 0 (any order within it), then round 1, then round 2: only a2 is left by then
    assert sorted(order[:3]) == ["a0", "b0", "c0"]
    assert sorted(order[3:6]) == ["FAIL", "a1", "c1"]
    assert order[6:] == ["a2"]
    assert state["max"] == 2
    a1 = next(m for m in seen if m[-1]["content"] == "a1")
    assert [m["content"] for m in a1] == ["SYS", "a0", "a0!", "a1"]  # its own answers only
    assert [(r.session, r.turn, r.ok) for r in result.records] == [
        (0, 0, True), (0, 1, True), (0, 2, True), (1, 0, True), (1, 1, False),
        (2, 0, True), (2, 1, True),
    ]  # fmt: skip
    assert result.config["dropped"] == 1 and result.config["turn_order"] == "rounds"

"""The OpenAI-compatible HTTP edge over the real model, driven by the official client.

Greedy output equals the engine's own; streams end with ``data: [DONE]``; usage is right,
and whole responses and the usage chunk carry the ``pdserve`` extension;
bad input gets OpenAI's error JSON with the right 4xx and the server keeps serving; a client
that disconnects frees every KV block within a second.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace

import aiohttp
import jsonschema
import openai
import pytest
import pytest_asyncio
import torch
from openai import AsyncOpenAI

from bench.openai_features import WEATHER_TOOL
from engine.sampling_params import SamplingParams
from services.gateway.backend import GenerateChunk, GenerateInput, ServedBy
from services.gateway.engine_backend import EngineBackend
from services.gateway.http_server import HttpServer, create_app
from services.gateway.service import GatewayService
from tests.services.gateway.harness import MAX_BODY, MAX_MODEL_LEN, MODEL, running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

GREEDY = {"temperature": 0}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gw(make_engine):
    async with running_gateway(make_engine, grpc=False) as g:
        yield g


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def http():
    async with aiohttp.ClientSession() as s:
        yield s


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(gw):
    c = AsyncOpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    await c.close()


def _sse_events(raw: bytes) -> list[str]:
    text = raw.decode("utf-8")
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    frames = text.split("\n\n")
    assert frames[-1] == ""
    for f in frames[:-1]:
        assert f.startswith("data: "), f
    return [f.removeprefix("data: ") for f in frames[:-1]]


# -- the official client ---------------------------------------------------------------------


async def test_streaming_chat_equals_engine(gw, client, default_tokenizer) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = [c async for c in stream]
    tok = default_tokenizer
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    ref_ids, ref_text = await gw.reference(ids, SamplingParams(max_tokens=12, temperature=0))

    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert {c.model for c in chunks} == {MODEL}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref_text and text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == ("length" if len(ref_ids) == 12 else "stop")
    assert all(r is None for r in reasons[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), len(ref_ids))
    assert usage.total_tokens == len(ids) + len(ref_ids)


async def test_completion_equals_engine(gw, client, default_tokenizer) -> None:
    prompt = "The capital of France is"
    resp = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, **GREEDY)
    ids = default_tokenizer.encode(prompt)
    ref_ids, ref_text = await gw.reference(ids, SamplingParams(max_tokens=8, temperature=0))
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert resp.model == MODEL
    assert resp.choices[0].text == ref_text
    assert resp.choices[0].finish_reason == ("length" if len(ref_ids) == 8 else "stop")
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == len(ref_ids)
    # token-id prompts give the same completion
    by_ids = await client.completions.create(model=MODEL, prompt=ids, max_tokens=8, **GREEDY)
    assert by_ids.choices[0].text == ref_text


async def test_n_choices_are_the_seeded_requests_of_seed_plus_index(gw, client) -> None:
    """Choice i of a seeded request of n is the same request with n=1 and seed+i, whole
    and streamed; usage counts the prompt once and every choice's tokens."""
    prompt = "Once upon a time"
    args = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 7}
    singles = [await client.completions.create(**{**args, "seed": 7 + i}) for i in range(3)]
    assert len({r.choices[0].text for r in singles}) > 1  # the seeds differ, so do the texts
    whole = await client.completions.create(**args, n=3)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.text for c in whole.choices] == [r.choices[0].text for r in singles]
    assert whole.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert whole.usage.completion_tokens == sum(r.usage.completion_tokens for r in singles)
    chat_args = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 11,
    }
    chat_singles = [
        await client.chat.completions.create(**{**chat_args, "seed": 11 + i}) for i in range(2)
    ]
    stream = await client.chat.completions.create(
        **chat_args, n=2, stream=True, stream_options={"include_usage": True}
    )
    texts = ["", ""]
    roles = [None, None]
    finish = [None, None]
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            roles[c.index] = roles[c.index] or c.delta.role
            finish[c.index] = finish[c.index] or c.finish_reason
    assert texts == [r.choices[0].message.content for r in chat_singles]
    assert roles == ["assistant", "assistant"]
    assert finish == [r.choices[0].finish_reason for r in chat_singles]
    assert usage is not None
    assert usage.completion_tokens == sum(r.usage.completion_tokens for r in chat_singles)
    assert await gw.wait_blocks_free()


WEATHER = WEATHER_TOOL  # the acceptance bench's tool: a city and a unit
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


async def _streamed_calls(stream) -> tuple[str, list[tuple[str, str, str]], str | None]:
    """Assemble a streamed turn as the OpenAI SDK's users do: content, calls by index
    (id, name, arguments) and the finish reason."""
    content, calls, finish = "", {}, None
    async for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, ["", "", ""])
                entry[0] = d.id or entry[0]
                entry[1] = d.function.name or entry[1]
                entry[2] += d.function.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
async def test_forced_tool_calls_come_back_valid_whole_and_streamed(gw, client, choice) -> None:
    """tool_choice required / named: the output is constrained to the tool's schema, so even
    the small model returns valid arguments; whole and streamed give the same calls."""
    args = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": choice}
    args.update(max_tokens=40, temperature=0)
    whole = (await client.chat.completions.create(**args)).choices[0]
    calls = whole.message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), WEATHER["function"]["parameters"])
        assert c.id.startswith("call_") and c.type == "function"
    assert whole.finish_reason == ("tool_calls" if choice == "required" else "stop")
    assert not whole.message.content
    content, streamed, finish = await _streamed_calls(
        await client.chat.completions.create(stream=True, **args)
    )
    assert content == "" and finish == whole.finish_reason
    assert [(n, json.loads(a)) for _, n, a in streamed] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls
    ]
    assert all(i.startswith("call_") for i, _, _ in streamed)


async def test_a_tool_result_sent_back_gets_an_answer(gw, client) -> None:
    """The rest of the conversation: the assistant's call and the tool's result in the
    history (tool_choice auto), and the model answers in text."""
    arguments = '{"city": "Paris", "unit": "celsius"}'
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    resp = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=16, temperature=0
    )
    choice = resp.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert "<tool" not in choice.message.content  # an answer, not the result echoed back
    assert choice.finish_reason in ("stop", "length")


async def test_models_endpoint(client) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "pdserve"


async def test_client_sees_openai_errors(client) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        await client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    assert nf.value.status_code == 404
    assert nf.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], n=17
        )
    assert bad.value.body["param"] == "n"


# -- raw HTTP: wire format -------------------------------------------------------------------


async def test_sse_framing_of_a_streamed_completion(gw, http) -> None:
    body = {
        "model": MODEL,
        "prompt": "1, 2, 3,",
        "max_tokens": 6,
        "stream": True,
        "logprobs": 0,
        "ignore_eos": True,
        **GREEDY,
    }
    async with http.post(gw.base_url + "/v1/completions", json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = _sse_events(await r.read())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "usage" not in chunks[-1]  # include_usage was not asked for
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    lps = [lp for c in chunks for lp in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert len(tokens) == len(lps) == 6
    assert all(lp <= 0 for lp in lps)
    assert "".join(tokens) == "".join(c["choices"][0]["text"] for c in chunks)


async def test_non_streaming_chat_with_logprobs(gw, http, default_tokenizer) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hi"}],
        "max_completion_tokens": 5,
        "logprobs": True,
        "ignore_eos": True,
        **GREEDY,
    }
    async with http.post(gw.base_url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        obj = await r.json()
    assert obj["object"] == "chat.completion"
    assert obj["choices"][0]["message"]["role"] == "assistant"
    content = obj["choices"][0]["logprobs"]["content"]
    assert len(content) == obj["usage"]["completion_tokens"] == 5
    assert "".join(c["token"] for c in content) == obj["choices"][0]["message"]["content"]
    tok = default_tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Say hi"}])
    ids = tok.encode(text, add_special_tokens=False)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=True)
    toks: list[float] = []
    async for ev in gw.backend.engine.generate("ref-lp", ids, params):
        toks.extend(ev.new_logprobs)
    assert [c["logprob"] for c in content] == pytest.approx(toks, abs=1e-4)


async def _post(http, gw, path: str, body: dict) -> tuple[int, dict]:
    async with http.post(gw.base_url + path, json={"model": MODEL, **body}) as r:
        return r.status, await r.json()


async def _stream(http, gw, path: str, body: dict) -> list[dict]:
    async with http.post(gw.base_url + path, json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status == 200
        events = _sse_events(await r.read())
    return [json.loads(e) for e in events[:-1]]


async def test_chat_top_logprobs_are_the_engines_distribution(gw, http, default_tokenizer):
    """Five alternatives per token, OpenAI's shape; the first token's are the log_softmax
    of the engine's logits for the prompt."""
    messages = [{"role": "user", "content": "Name a colour."}]
    body = {"messages": messages, "max_tokens": 4, "logprobs": True, "top_logprobs": 5,
            "ignore_eos": True, **GREEDY}  # fmt: skip
    status, obj = await _post(http, gw, "/v1/chat/completions", body)
    assert status == 200, obj
    content = obj["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        top = entry["top_logprobs"]
        assert len(top) == 5 and set(top[0]) == {"token", "logprob", "bytes"}
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert (top[0]["token"], top[0]["logprob"]) == (entry["token"], entry["logprob"])  # greedy
        assert all(bytes(t["bytes"]).decode("utf-8", "replace") == t["token"] for t in top)
    tok = default_tokenizer
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    engine = gw.backend.engine
    logits = await engine.call(lambda: engine.engine.prompt_logits(ids))
    want = torch.topk(torch.log_softmax(logits.double(), -1), 5)
    first = content[0]["top_logprobs"]
    assert [t["logprob"] for t in first] == pytest.approx(want.values.tolist(), abs=1e-4)
    assert [t["token"] for t in first] == [tok.decode([i]) for i in want.indices.tolist()]
    # streamed: the same alternatives, chunk by chunk
    chunks = await _stream(http, gw, "/v1/chat/completions", body)
    streamed = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]  # fmt: skip
    assert streamed == content


async def test_completion_logprobs_n_gives_alternatives_per_token(gw, http) -> None:
    body = {"prompt": "1, 2, 3,", "max_tokens": 5, "logprobs": 3, "ignore_eos": True,
            "temperature": 1.0, "seed": 11}  # fmt: skip
    status, obj = await _post(http, gw, "/v1/completions", body)
    assert status == 200, obj
    lp = obj["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["top_logprobs"]) == 5
    for token, token_lp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                    strict=True):  # fmt: skip
        assert len(top) in (3, 4) and top[token] == token_lp  # the sampled token is listed
        assert token_lp <= max(top.values())
    assert lp["text_offset"][0] == 0
    chunks = await _stream(http, gw, "/v1/completions", body)
    tops = [t for c in chunks if c["choices"][0]["logprobs"]
            for t in c["choices"][0]["logprobs"]["top_logprobs"]]  # fmt: skip
    assert tops == lp["top_logprobs"]  # seeded: the same tokens, the same alternatives


async def test_echo_returns_the_prompt_before_the_completion(gw, http, default_tokenizer):
    prompt = "The capital of France is"
    body = {"prompt": prompt, "max_tokens": 6, **GREEDY}
    _, plain = await _post(http, gw, "/v1/completions", body)
    completion = plain["choices"][0]["text"]
    status, echoed = await _post(http, gw, "/v1/completions", {**body, "echo": True})
    assert status == 200 and echoed["choices"][0]["text"] == prompt + completion
    assert echoed["usage"] == plain["usage"]
    chunks = await _stream(http, gw, "/v1/completions", {**body, "echo": True})
    assert chunks[0]["choices"][0]["text"].startswith(prompt)
    assert "".join(c["choices"][0]["text"] for c in chunks) == prompt + completion
    ids = default_tokenizer.encode(prompt)
    _, by_ids = await _post(http, gw, "/v1/completions", {**body, "prompt": ids, "echo": True})
    assert by_ids["choices"][0]["text"] == default_tokenizer.decode(ids) + completion


async def test_include_stop_str_in_output_keeps_the_stop_string(gw, http) -> None:
    body = {"prompt": "Count: one, two, three, four, five,", "max_tokens": 12,
            "ignore_eos": True, **GREEDY}  # fmt: skip
    _, plain = await _post(http, gw, "/v1/completions", body)
    text = plain["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    at = text.find(stop)
    _, cut = await _post(http, gw, "/v1/completions", {**body, "stop": [stop]})
    assert cut["choices"][0]["text"] == text[:at]
    kept_body = {**body, "stop": [stop], "include_stop_str_in_output": True}
    _, kept = await _post(http, gw, "/v1/completions", kept_body)
    assert kept["choices"][0]["text"] == text[: at + len(stop)]
    assert kept["choices"][0]["finish_reason"] == cut["choices"][0]["finish_reason"] == "stop"
    chunks = await _stream(http, gw, "/v1/completions", kept_body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text[: at + len(stop)]


_CHAT_X = {"messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
        ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
        ("/v1/chat/completions", {**_CHAT_X, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {**_CHAT_X, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
async def test_refused_logprob_requests_are_400s_naming_the_parameter(
    gw, http, path, body, param
) -> None:
    status, obj = await _post(http, gw, path, body)
    assert status == 400 and obj["error"]["param"] == param, obj


async def test_health_and_metrics(gw, http) -> None:
    async with http.get(gw.base_url + "/health") as r:
        assert r.status == 200
    async with http.get(gw.base_url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    ttft = re.search(r"^pdserve:time_to_first_token_seconds_count\{[^}]*\} (\S+)$", text, re.M)
    assert ttft is not None and float(ttft.group(1)) >= 3
    for name in ("inter_token_latency_seconds_count", "e2e_request_latency_seconds_count"):
        assert re.search(rf"^pdserve:{name}\{{", text, re.M), name
    assert re.search(r"^pdserve:num_requests_running\{[^}]*\} 0\.0$", text, re.M)
    ok = r'^pdserve:requests_total\{endpoint="/v1/completions",status="200"\} (\S+)$'
    assert float(re.search(ok, text, re.M).group(1)) >= 2  # type: ignore[union-attr]


# -- raw HTTP: bad input ---------------------------------------------------------------------


def _body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "Hello", **fields}).encode()


BAD = [
    # (path, raw body, status, param, code, message fragment)
    ("completions", b'{"model": "x", ', 400, None, "invalid_json", "could not parse"),
    ("completions", b'{"model": "\xff\xfe"}', 400, None, "invalid_encoding", "UTF-8"),
    ("completions", b"x" * (MAX_BODY + 1), 413, None, "request_too_large", "limit of 65536"),
    ("completions", _body(max_tokens="8"), 400, "max_tokens", "invalid_type", "an integer"),
    ("completions", _body(prompt=None), 400, "prompt", "missing", "'prompt'"),
    ("completions", _body(model="nope"), 404, "model", "model_not_found", "`nope`"),
    ("completions", _body(prompt="hi " * 300), 400, "prompt", "context_length_exceeded", "256"),
    ("completions", _body(max_tokens=10**6), 400, "max_tokens", None, "exceeds max_model_len"),
    ("completions", _body(n=17), 400, "n", None, "at most 16"),
    ("completions", _body(prompt="x \ud800"), 400, "prompt", None, "not valid Unicode"),
    ("completions", _body(prompt=[1, 10**9]), 400, "prompt", None, "is not a token id"),
    (
        "chat/completions",
        _body(messages=[{"role": "x", "content": "y"}]),
        400,
        "messages[0].role",
        None,
        "must be one of",
    ),
    ("chat/completions", _body(messages="hi"), 400, "messages", "invalid_type", "an array"),
    ("models", b"", 405, None, "method_not_allowed", "POST"),
    ("nowhere", b"{}", 404, None, "not_found", "/v1/nowhere"),
]


@pytest.mark.parametrize(("path", "data", "status", "param", "code", "needle"), BAD)
async def test_bad_input_gets_openai_error(gw, http, path, data, status, param, code, needle):
    url = f"{gw.base_url}/v1/{path}"
    async with http.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        assert r.status == status
        assert r.headers["Content-Type"].startswith("application/json")
        err = (await r.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["param"], err["code"]) == (param, code)
    assert needle in err["message"]
    assert err["type"] == "invalid_request_error"


async def test_still_serving_after_bad_input(gw, http) -> None:
    async with http.post(gw.base_url + "/v1/completions", data=b"\xff" * 100) as r:
        assert r.status == 400
    async with http.post(gw.base_url + "/v1/completions", data=_body(max_tokens=3, **GREEDY)) as r:
        assert r.status == 200
        assert (await r.json())["usage"]["completion_tokens"] >= 1
    assert await gw.wait_blocks_free()


# -- disconnects, overload, auth, draining ---------------------------------------------------


async def test_client_disconnect_mid_stream_frees_blocks(gw) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": MAX_MODEL_LEN - 64,
        "ignore_eos": True,
        "stream": True,
    }
    async with aiohttp.ClientSession() as s:
        r = await s.post(gw.base_url + "/v1/chat/completions", json=body)
        assert r.status == 200
        seen = 0
        async for line in r.content:
            seen += line.startswith(b"data: ")
            if seen == 4:
                break
        assert not gw.all_blocks_free()
        r.close()  # drop the connection mid-stream
    assert await gw.wait_blocks_free(1.0)


async def test_client_disconnect_while_waiting_for_a_whole_response(gw) -> None:
    body = _body(max_tokens=MAX_MODEL_LEN - 16, ignore_eos=True)
    async with aiohttp.ClientSession() as s:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(s.post(gw.base_url + "/v1/completions", data=body), 0.5)
    assert await gw.wait_blocks_free(1.0)


async def test_api_keys_and_draining(gw, http) -> None:
    model = gw.service.models[MODEL]
    service = GatewayService(gw.backend, [model], api_keys=["sekret"])
    server = HttpServer(create_app(service), "127.0.0.1", 0, drain_timeout_s=1.0)
    base = f"http://127.0.0.1:{await server.start()}"
    try:
        async with http.get(base + "/v1/models") as r:
            assert r.status == 401
            assert (await r.json())["error"]["code"] == "invalid_api_key"
        wrong = {"Authorization": "Bearer nope"}
        async with http.get(base + "/v1/models", headers=wrong) as r:
            assert r.status == 401
        key = {"Authorization": "Bearer sekret"}
        async with http.get(base + "/v1/models", headers=key) as r:
            assert r.status == 200
        async with http.get(base + "/health") as r:
            assert r.status == 200  # probes need no key
        service.start_draining()
        async with http.get(base + "/health") as r:
            assert r.status == 503
        async with http.post(base + "/v1/completions", data=_body(), headers=key) as r:
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "service_unavailable"
    finally:
        await server.stop()


@pytest.mark.parametrize(
    ("path", "body", "name", "before"),
    [
        ("/v1/completions", {"prompt": "1, 2, 3,"}, "completion_started", 1),
        # the role chunk, then the first token's chunk
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]},
         "chat_completion_started", 2),
    ],
)  # fmt: skip
async def test_the_first_chunk_goes_out_before_the_start_is_logged(
    gw, http, monkeypatch, path, body, name, before
) -> None:
    """A log line is a write that may wait for the GIL: it must not delay the first token."""
    import services.gateway.http_relay as relay
    import services.gateway.http_server as server

    order: list[str] = []
    real_send = relay.SseRelay._send

    async def send(self, obj):
        order.append("send")
        await real_send(self, obj)

    class Log:
        def __getattr__(self, level):
            return lambda event, **kw: order.append(event)

    monkeypatch.setattr(relay.SseRelay, "_send", send)
    monkeypatch.setattr(server, "log", Log())
    full = {"model": MODEL, "max_tokens": 4, "stream": True, "ignore_eos": True, **body, **GREEDY}
    async with http.post(gw.base_url + path, json=full) as r:
        assert r.status == 200
        _sse_events(await r.read())
    assert order.count(name) == 1
    assert order.index(name) == before, order  # right after the first token's frames


class _Served:
    """The real engine backend, its last chunk stamped with where a cluster served it (what
    ``ClusterBackend`` does from the decode worker's last event: test_cluster_backend.py)."""

    SERVED = ServedBy(prefill_worker_id="prefill-1", decode_worker_id="decode-0",
                      kv_transfer_bytes=737_280)  # fmt: skip

    def __init__(self, inner: EngineBackend) -> None:
        self.inner = inner

    async def ready(self) -> bool:
        return await self.inner.ready()

    async def generate(self, req: GenerateInput) -> AsyncIterator[GenerateChunk]:
        async with aclosing(self.inner.generate(req)) as chunks:
            async for c in chunks:
                yield replace(c, served_by=self.SERVED) if c.finish_reason else c


async def test_whole_responses_and_the_usage_chunk_say_where_the_request_was_served(
    gw, http
) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "ignore_eos": True, **GREEDY}  # fmt: skip
    nothing = {"kv_transfer_bytes": 0, "prefill_worker_id": "", "decode_worker_id": ""}
    # the in-process engine: one process, nothing moved
    async with http.post(gw.base_url + "/v1/chat/completions", json=chat) as r:
        assert (await r.json())["pdserve"] == nothing
    served = {"kv_transfer_bytes": 737_280, "prefill_worker_id": "prefill-1",
              "decode_worker_id": "decode-0"}  # fmt: skip
    service = GatewayService(_Served(gw.backend), [gw.service.models[MODEL]])
    server = HttpServer(create_app(service), "127.0.0.1", 0, drain_timeout_s=1.0)
    base = f"http://127.0.0.1:{await server.start()}"
    try:
        async with http.post(base + "/v1/chat/completions", json=chat) as r:
            assert (await r.json())["pdserve"] == served
        body = {"model": MODEL, "prompt": "1, 2,", "max_tokens": 3, "ignore_eos": True, **GREEDY}
        async with http.post(base + "/v1/completions", json=body) as r:
            assert (await r.json())["pdserve"] == served
        for path, req in (("/v1/completions", body), ("/v1/chat/completions", chat)):
            stream = {**req, "stream": True, "stream_options": {"include_usage": True}}
            async with http.post(base + path, json=stream) as r:
                chunks = [json.loads(e) for e in _sse_events(await r.read())[:-1]]
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
            assert chunks[-1]["pdserve"] == served
            assert all("pdserve" not in c for c in chunks[:-1])
            async with http.post(base + path, json={**req, "stream": True}) as r:
                chunks = [json.loads(e) for e in _sse_events(await r.read())[:-1]]
            assert all("pdserve" not in c and "usage" not in c for c in chunks)  # not asked
    finally:
        await server.stop()

"""The gRPC edge over the real model: Generate equals the engine's output, bad input gets
INVALID_ARGUMENT (or NOT_FOUND / RESOURCE_EXHAUSTED), cancels free KV, health is SERVING.
Admission (cap, queue, rate limit, size) is tested in test_admission_edges.py."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.sampling_params import SamplingParams
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.services.gateway.harness import MAX_BODY, MAX_MODEL_LEN, MODEL, running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gw(make_engine):
    async with running_gateway(make_engine, http=False) as g:
        yield g


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def channel(gw):
    async with grpc.aio.insecure_channel(gw.grpc_target) as ch:
        yield ch


@pytest.fixture
def stub(channel) -> gateway_pb2_grpc.GatewayStub:
    return gateway_pb2_grpc.GatewayStub(channel)


def _greedy(max_tokens: int, **kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


async def _events(stub, req: gateway_pb2.GenerateRequest) -> list[gateway_pb2.GenerateEvent]:
    return [ev async for ev in stub.Generate(req, timeout=60)]


async def test_generate_stream_equals_engine(gw, stub, default_tokenizer) -> None:
    prompt = "The three primary colors are"
    req = gateway_pb2.GenerateRequest(
        request_id="mine-1",
        model=MODEL,
        prompt=prompt,
        sampling=_greedy(10, logprobs=True),
    )
    before = time.time_ns()
    events = await _events(stub, req)
    after = time.time_ns()
    stamps = [ev.produced_unix_ns for ev in events]
    assert stamps == sorted(stamps) and before < stamps[0] and stamps[-1] <= after
    ids = default_tokenizer.encode(prompt)
    ref_ids, ref_text = await gw.reference(ids, SamplingParams(max_tokens=10, temperature=0))
    assert {ev.request_id for ev in events} == {"mine-1"}
    assert [t for ev in events for t in ev.token_ids] == ref_ids
    assert "".join(ev.text for ev in events) == ref_text
    assert sum(len(ev.logprobs) for ev in events) == len(ref_ids)
    last = events[-1]
    assert all(ev.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for ev in events[:-1])
    assert last.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(ids), len(ref_ids))
    assert 0 < last.timing.first_token_seconds <= last.timing.total_seconds
    assert all(not ev.HasField("usage") for ev in events[:-1])


async def test_top_logprobs_and_a_kept_stop_string(gw, stub, default_tokenizer) -> None:
    prompt = "The three primary colors are"
    ids = default_tokenizer.encode(prompt)
    _, ref_text = await gw.reference(ids, SamplingParams(max_tokens=10, temperature=0))
    stop = ref_text[4:7]
    sampling = _greedy(10, logprobs=True, top_logprobs=3, stop=[stop],
                       include_stop_str_in_output=True)  # fmt: skip
    events = await _events(stub, gateway_pb2.GenerateRequest(prompt=prompt, sampling=sampling))
    assert "".join(ev.text for ev in events) == ref_text[: ref_text.find(stop) + len(stop)]
    for ev in events:
        assert len(ev.top_logprobs) == len(ev.token_ids) == len(ev.logprobs)
        for tok, lp, top in zip(ev.token_ids, ev.logprobs, ev.top_logprobs, strict=True):
            assert len(top.token_ids) == len(top.logprobs) == 3
            assert (top.token_ids[0], top.logprobs[0]) == (tok, lp)  # greedy: the most likely
    bad = _greedy(4, top_logprobs=3)  # without logprobs
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _events(stub, gateway_pb2.GenerateRequest(prompt=prompt, sampling=bad))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_logprobs" in (e.value.details() or "")


async def test_penalties_bias_and_min_tokens_reach_the_engine(gw, stub, default_tokenizer) -> None:
    """Every SamplingParams field the proto carries is applied, as over HTTP: the output is
    the engine's own for the same parameters (the gateway once dropped these five)."""
    prompt = "List the colours of the rainbow:"
    ids = default_tokenizer.encode(prompt)
    forced = default_tokenizer.encode(" blue", add_special_tokens=False)[0]
    params = SamplingParams(max_tokens=12, temperature=0, presence_penalty=1.5,
                            frequency_penalty=0.5, repetition_penalty=1.3, min_tokens=12,
                            logit_bias=((forced, 8.0),))  # fmt: skip
    want, _ = await gw.reference(ids, params)
    plain, _ = await gw.reference(ids, SamplingParams(max_tokens=12, temperature=0))
    assert want != plain  # the fields change the output, so dropping them shows
    sampling = _greedy(12, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3,
                       min_tokens=12, logit_bias={forced: 8.0}, logprobs=True)  # fmt: skip
    events = await _events(stub, gateway_pb2.GenerateRequest(prompt=prompt, sampling=sampling))
    assert [t for ev in events for t in ev.token_ids] == want


async def test_chat_and_token_id_inputs(gw, stub, default_tokenizer) -> None:
    chat = common_pb2.ChatMessages(
        messages=[common_pb2.ChatMessage(role="user", content="Name a fruit.")]
    )
    req = gateway_pb2.GenerateRequest(chat=chat, sampling=_greedy(6), return_token_ids=True)
    events = await _events(stub, req)
    tok = default_tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Name a fruit."}])
    ids = tok.encode(text, add_special_tokens=False)
    ref_ids, _ = await gw.reference(ids, SamplingParams(max_tokens=6, temperature=0))
    assert [t for ev in events for t in ev.token_ids] == ref_ids
    assert events[0].request_id.startswith("gen-")  # assigned by the gateway
    # The same prompt as token ids, without return_token_ids: text only.
    by_ids = gateway_pb2.GenerateRequest(
        model=MODEL, prompt_token_ids=common_pb2.TokenIds(ids=ids), sampling=_greedy(6)
    )
    events2 = await _events(stub, by_ids)
    assert all(not ev.token_ids for ev in events2)
    assert "".join(e.text for e in events2) == "".join(e.text for e in events)


async def test_list_models(stub) -> None:
    reply = await stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=5)
    assert [(m.id, m.max_model_len, m.owned_by) for m in reply.models] == [
        (MODEL, MAX_MODEL_LEN, "pdserve")
    ]


def _req(**fields) -> gateway_pb2.GenerateRequest:
    fields.setdefault("prompt", "Hello")
    return gateway_pb2.GenerateRequest(**fields)


BAD = [
    (_req(prompt=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt must not be empty"),
    (gateway_pb2.GenerateRequest(model=MODEL), grpc.StatusCode.INVALID_ARGUMENT, "one input"),
    (_req(model="gpt-9"), grpc.StatusCode.NOT_FOUND, "'gpt-9' is not served"),
    (
        _req(sampling=common_pb2.SamplingParams(temperature=-1)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature=-1.0 is invalid",
    ),
    (_req(sampling=common_pb2.SamplingParams(top_p=0)), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (
        _req(sampling=common_pb2.SamplingParams(max_tokens=0)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_tokens=0",
    ),
    (
        _req(sampling=common_pb2.SamplingParams(max_tokens=10**6)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "exceeds max_model_len=256",
    ),
    (_req(prompt="hi " * 300), grpc.StatusCode.INVALID_ARGUMENT, "maximum context length is 256"),
    (
        _req(prompt=None, prompt_token_ids=common_pb2.TokenIds(ids=[1, 99999])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt_token_ids.ids[1]=99999",
    ),
    (
        _req(prompt=None, chat=common_pb2.ChatMessages()),
        grpc.StatusCode.INVALID_ARGUMENT,
        "at least one message",
    ),
    (
        _req(
            prompt=None,
            chat=common_pb2.ChatMessages(
                messages=[common_pb2.ChatMessage(role="wizard", content="x")]
            ),
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "role must be one of",
    ),
    (_req(request_id="x" * 129), grpc.StatusCode.INVALID_ARGUMENT, "at most 128"),
    (_req(request_id="tab\there"), grpc.StatusCode.INVALID_ARGUMENT, "printable ASCII"),
    (
        _req(sampling=common_pb2.SamplingParams(stop_token_ids=[10**7])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "outside the vocabulary",
    ),
]


@pytest.mark.parametrize(("req", "code", "needle"), BAD)
async def test_bad_input_status(gw, stub, req, code, needle) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _events(stub, req)
    assert info.value.code() == code
    assert needle in info.value.details()


async def test_undecodable_and_oversized_requests(gw, channel) -> None:
    raw = channel.unary_stream(
        "/pdserve.v1.Gateway/Generate",
        request_serializer=lambda b: b,
        response_deserializer=gateway_pb2.GenerateEvent.FromString,
    )
    # field 10 (prompt), length-delimited, holding bytes that are not UTF-8
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [ev async for ev in raw(b"\x52\x02\xff\xfe", timeout=10)]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "could not be decoded" in info.value.details()
    stub = gateway_pb2_grpc.GatewayStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _events(stub, _req(prompt="a" * (MAX_BODY + 10)))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(await _events(stub, _req(sampling=_greedy(2)))) >= 1  # still serving
    assert await gw.wait_blocks_free()


async def test_client_cancel_frees_blocks(gw, stub) -> None:
    call = stub.Generate(
        _req(sampling=common_pb2.SamplingParams(max_tokens=200, ignore_eos=True)), timeout=60
    )
    n = 0
    async for _ in call:
        n += 1
        if n == 3:
            break
    assert not gw.all_blocks_free()
    call.cancel()
    assert await gw.wait_blocks_free(1.0)


async def test_deadline_frees_blocks(gw, stub) -> None:
    call = stub.Generate(
        _req(sampling=common_pb2.SamplingParams(max_tokens=200, ignore_eos=True)), timeout=0.5
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in call:
            pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert await gw.wait_blocks_free(1.0)


async def test_metrics_count_grpc_outcomes(gw) -> None:
    text = gw.service.metrics.render().decode()
    assert 'pdserve:requests_total{endpoint="grpc.Generate",status="OK"}' in text
    assert 'endpoint="grpc.Generate",status="INVALID_ARGUMENT"' in text
    assert 'endpoint="grpc.Generate",status="CANCELLED"' in text


async def test_the_first_event_goes_out_before_the_start_is_logged(gw, stub, monkeypatch) -> None:
    """A log line is a write that may wait for the GIL: it must not delay the first token."""
    import services.gateway.grpc_server as server

    order: list[str] = []
    real_event = server.conv.event

    def event(*args, **kwargs):
        order.append("event")
        return real_event(*args, **kwargs)

    class Log:
        def __getattr__(self, level):
            return lambda name, **kw: order.append(name)

    monkeypatch.setattr(server.conv, "event", event)
    monkeypatch.setattr(server, "log", Log())
    req = gateway_pb2.GenerateRequest(model=MODEL, prompt="Hello", sampling=_greedy(3))
    events = await _events(stub, req)
    assert len(events) >= 2
    assert order[:2] == ["event", "grpc_generate_started"], order
    assert order.count("grpc_generate_started") == 1


async def test_health_serving_then_draining(gw, channel, stub) -> None:
    # Last in the module: draining is one-way.
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "pdserve.v1.Gateway"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    gw.service.start_draining()
    await gw.grpc.drain()
    reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _events(stub, _req())
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    await asyncio.sleep(0)

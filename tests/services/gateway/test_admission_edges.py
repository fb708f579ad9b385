"""Admission at both edges over the real model: the concurrency cap and its queue (429 with
Retry-After / RESOURCE_EXHAUSTED, 503 / UNAVAILABLE while draining), per-key rate limits, a
prompt too long to fit refused before any templating or tokenizing, tokenizing off the event
loop, a slow reader's stream cut after the write timeout, and the connection cap.

Each test builds its own ``GatewayService`` (its own limits) over the module's engine
backend, so the backend is not what refuses: the service is, whatever the backend.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import grpc
import pytest
import pytest_asyncio

from engine.step_budget import StepBudget
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.admission import AdmissionLimits
from services.gateway.backend import GenerateChunk, GenerateInput
from services.gateway.grpc_server import grpc_server
from services.gateway.http_server import HttpServer, create_app
from services.gateway.service import GatewayService
from tests.services.gateway.harness import MODEL, Gateway, running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

LONG = {"model": MODEL, "prompt": "Count:", "max_tokens": 200, "ignore_eos": True, "stream": True}
SHORT = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gw(make_engine):
    async with running_gateway(make_engine, http=False, grpc=False) as g:
        yield g


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def http():
    async with aiohttp.ClientSession() as s:
        yield s


@asynccontextmanager
async def _served(
    service: GatewayService, **server_args: Any
) -> AsyncIterator[tuple[str, HttpServer]]:
    app_args = {k: server_args.pop(k) for k in ("max_body_bytes", "write_timeout_s")
                if k in server_args}  # fmt: skip
    server = HttpServer(create_app(service, **app_args), "127.0.0.1", 0, 1.0, **server_args)
    base = f"http://127.0.0.1:{await server.start()}"
    try:
        yield base, server
    finally:
        await server.stop()


def _service(gw: Gateway, limits: AdmissionLimits, **kw: Any) -> GatewayService:
    return GatewayService(gw.backend, [gw.service.models[MODEL]], admission=limits, **kw)


async def _eventually(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)
    assert check(), what


async def _post(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], **kw: Any
) -> tuple[int, dict[str, str], dict[str, Any]]:
    async with http.post(url, json=body, **kw) as r:
        return r.status, dict(r.headers), await r.json()


def _refused_count(service: GatewayService, reason: str) -> float:
    text = service.metrics.render().decode()
    line = f'pdserve:requests_refused_total{{reason="{reason}"}}'
    return float(next(x for x in text.splitlines() if x.startswith(line)).split()[-1])


# -- the cap and its queue -------------------------------------------------------------------


async def test_the_cap_follows_the_engine_s_batch_target(gw, http) -> None:
    """The local backend tells admission its engine's batch target at every request, as a
    placement tells the fleet's; the cap follows it (and the gauge shows it)."""
    service = _service(gw, AdmissionLimits(16, max_queued=4, follow_fleet=True))
    engine, budget = gw.backend.engine, gw.engine.step_budget
    three = StepBudget.calibrated([(1, 0.01), (8, 0.08)], max_num_seqs=16, target_s=0.03)
    await engine.call(lambda: setattr(gw.engine, "step_budget", three))
    await engine.call(lambda: None)  # the stats snapshot after it
    gw.backend.on_target_batch = service.admission.follow
    try:
        async with _served(service) as (base, _):
            status, _, _ = await _post(http, base + "/v1/completions", SHORT)
            assert status == 200
            assert service.admission.limits.max_concurrent == 3
            assert service.admission.limits.max_queued == 4  # the queue keeps its bound
            text = service.metrics.render().decode()
            assert "pdserve:max_concurrent_requests 3.0" in text
    finally:
        gw.backend.on_target_batch = lambda n: None
        await engine.call(lambda: setattr(gw.engine, "step_budget", budget))


async def test_http_cap_queues_then_refuses_with_retry_after_and_draining_refuses_the_queue(
    gw, http
) -> None:
    service = _service(gw, AdmissionLimits(1, max_queued=1, queue_timeout_s=60))
    async with _served(service) as (base, _):
        url = base + "/v1/completions"
        async with http.post(url, json=LONG) as busy:
            assert busy.status == 200
            await busy.content.readline()  # generating now: the one slot is taken
            queued = asyncio.create_task(_post(http, url, SHORT))
            await _eventually(lambda: service.admission.queued == 1, "the second one waits")
            status, headers, body = await _post(http, url, SHORT)
            assert status == 429
            assert int(headers["Retry-After"]) >= 1
            assert body["error"]["code"] == "rate_limit_exceeded"
            assert "limit of 1 concurrent requests and 1 waiting" in body["error"]["message"]
        # the busy stream is gone (client closed): its slot passes to the queued request
        status, _, body = await queued
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"

        async with http.post(url, json=LONG) as busy:
            await busy.content.readline()
            queued = asyncio.create_task(_post(http, url, SHORT))
            await _eventually(lambda: service.admission.queued == 1, "the second one waits")
            service.start_draining()
            status, _, body = await queued
            assert status == 503 and body["error"]["code"] == "service_unavailable"
        assert _refused_count(service, "overloaded") == 1
        assert _refused_count(service, "draining") == 1
    assert await gw.wait_blocks_free(5.0)


async def test_grpc_goes_through_the_same_admission(gw) -> None:
    service = _service(gw, AdmissionLimits(1, max_queued=0))
    server = grpc_server(service, "127.0.0.1", 0)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            sampling = common_pb2.SamplingParams(max_tokens=200, ignore_eos=True)
            long = gateway_pb2.GenerateRequest(model=MODEL, prompt="Count:", sampling=sampling)
            busy = stub.Generate(long, timeout=60)
            await busy.read()  # the slot is taken
            req = gateway_pb2.GenerateRequest(model=MODEL, prompt="Hi")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [ev async for ev in stub.Generate(req, timeout=60)]
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "limit of 1 concurrent requests" in info.value.details()
            assert int(dict(info.value.trailing_metadata() or ())["retry-after-ms"]) >= 1000
            # HTTP shares the count: the same service refuses there too
            async with _served(service) as (base, _), aiohttp.ClientSession() as http:
                status, headers, _ = await _post(http, base + "/v1/completions", SHORT)
                assert status == 429 and "Retry-After" in headers
            busy.cancel()
            await _eventually(lambda: service.admission.in_flight == 0, "the slot is freed")
            service.start_draining()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [ev async for ev in stub.Generate(req, timeout=60)]
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)
    assert await gw.wait_blocks_free(5.0)


# -- rate limits -----------------------------------------------------------------------------


async def test_each_api_key_has_its_own_rate_limit(gw, http) -> None:
    # a rate so low that no token comes back during the test: exactly the burst passes
    limits = AdmissionLimits(16, rate_per_key=0.001, burst=2)
    service = _service(gw, limits, api_keys=["alice", "bob"])
    alice = {"Authorization": "Bearer alice"}
    bob = {"Authorization": "Bearer bob"}
    async with _served(service) as (base, _):
        url = base + "/v1/completions"
        for _ in range(2):
            assert (await _post(http, url, SHORT, headers=alice))[0] == 200
        status, headers, body = await _post(http, url, SHORT, headers=alice)
        assert status == 429 and int(headers["Retry-After"]) > 100
        assert "rate limit of 0.001 requests/s" in body["error"]["message"]
        assert (await _post(http, url, SHORT, headers=bob))[0] == 200  # bob's own bucket
        # the gRPC edge draws from the same bucket
        server = grpc_server(service, "127.0.0.1", 0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                req = gateway_pb2.GenerateRequest(model=MODEL, prompt="Hi")
                md = (("authorization", "Bearer bob"),)
                assert [ev async for ev in stub.Generate(req, metadata=md, timeout=60)]
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    [ev async for ev in stub.Generate(req, metadata=md, timeout=60)]
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            await server.stop(0)
    assert _refused_count(service, "rate_limited") == 2


# -- prompt size and tokenizing --------------------------------------------------------------


@pytest.fixture
def no_tokenizing(gw, monkeypatch) -> list[str]:
    """Make templating and tokenizing fail loudly; returns the calls that were attempted."""
    calls: list[str] = []
    tok = gw.service.models[MODEL].tokenizer

    def refuse(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"{name} ran on a prompt that cannot fit")

        return call

    monkeypatch.setattr(tok, "encode", refuse("encode"))
    monkeypatch.setattr(tok, "apply_chat_template", refuse("apply_chat_template"))
    return calls


async def test_a_multi_mib_prompt_is_refused_before_templating_or_tokenizing(
    gw, http, no_tokenizing
) -> None:
    service = _service(gw, AdmissionLimits(4))
    text = "lorem ipsum " * ((3 << 20) // 12)  # 3 MiB
    async with _served(service, max_body_bytes=4 << 20) as (base, _):
        status, _, body = await _post(http, base + "/v1/completions", {**SHORT, "prompt": text})
        assert status == 400
        assert (body["error"]["code"], body["error"]["param"]) == (
            "context_length_exceeded", "prompt",
        )  # fmt: skip
        chat = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
        status, _, body = await _post(http, base + "/v1/chat/completions", chat)
        assert status == 400 and body["error"]["param"] == "messages"
        assert "cannot fit" in body["error"]["message"]
        ids = {**SHORT, "prompt": [1] * 300}  # token ids past the context: no id checked
        assert (await _post(http, base + "/v1/completions", ids))[0] == 400
    server = grpc_server(service, "127.0.0.1", 0, max_message_bytes=4 << 20)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{server.port}", options=[("grpc.max_send_message_length", 4 << 20)]
        ) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                req = gateway_pb2.GenerateRequest(model=MODEL, prompt=text)
                [ev async for ev in stub.Generate(req, timeout=60)]
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "cannot fit" in info.value.details()
    finally:
        await server.stop(0)
    assert no_tokenizing == []
    assert _refused_count(service, "too_long") == 4
    assert service.admission.in_flight == 0


async def test_the_event_loop_answers_while_a_prompt_is_tokenized(gw, monkeypatch) -> None:
    """Tokenizing is held until another client's request was answered: with tokenizing on
    the event loop, that answer could never come (the probe gives up after its deadline)."""
    tok = gw.service.models[MODEL].tokenizer
    real_encode = tok.encode
    tokenizing, release = threading.Event(), threading.Event()

    def held_encode(text: str, **kwargs: Any) -> list[int]:
        tokenizing.set()
        release.wait(120)  # past the probe's deadline: a blocked loop fails the probe
        return real_encode(text, **kwargs)

    monkeypatch.setattr(tok, "encode", held_encode)
    service = _service(gw, AdmissionLimits(4))
    probe: dict[str, Any] = {}

    def probe_models(url: str) -> None:
        try:
            if tokenizing.wait(30):
                with urllib.request.urlopen(url, timeout=15) as r:
                    probe["status"] = r.status
        except OSError as exc:
            probe["error"] = repr(exc)
        finally:
            release.set()

    async with _served(service) as (base, _), aiohttp.ClientSession() as http:
        thread = threading.Thread(target=probe_models, args=(base + "/v1/models",))
        thread.start()
        status, _, _ = await _post(http, base + "/v1/completions", SHORT)
        await asyncio.to_thread(thread.join, 60)
    assert probe == {"status": 200}
    assert status == 200


async def test_tokenizing_a_long_prompt_lets_the_event_loop_run(gw, monkeypatch) -> None:
    """The tokenizer lets go of the GIL while it works: the loop turns many times while one
    long encode runs on the service's thread (a tokenizer holding the GIL lets it turn once
    or twice: no other stream's token could go out meanwhile)."""
    model = gw.service.models[MODEL]
    tok = model.tokenizer
    real_encode = tok.encode
    span: list[float] = []

    def timed_encode(text: str, **kwargs: Any) -> list[int]:
        span.append(time.perf_counter())
        try:
            return real_encode(text, **kwargs)
        finally:
            span.append(time.perf_counter())

    monkeypatch.setattr(tok, "encode", timed_encode)
    text = "serving many streams at once " * 40_000  # 1.2 MB: most of a second to encode
    turns: list[float] = []
    encode = asyncio.ensure_future(gw.service.prepare(model.encode_text, text))
    while not encode.done():
        await asyncio.sleep(0.001)  # a turn that waits: the loop lets go of the GIL
        turns.append(time.perf_counter())
    assert len(await encode) > 40_000
    start, end = span
    during = sum(1 for t in turns if start < t < end)
    assert during > 50, (during, end - start)


# -- slow readers and connections ------------------------------------------------------------


class _Firehose:
    """A backend that streams 64 KiB chunks until it is closed: fills any socket buffer
    (no real model emits text that fast) and records that it was closed."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    async def ready(self) -> bool:
        return True

    async def generate(self, req: GenerateInput) -> AsyncIterator[GenerateChunk]:
        try:
            n = 0
            while True:
                n += 1
                yield GenerateChunk("x" * (64 << 10), (1,), (), None, 1, n)
                await asyncio.sleep(0)
        finally:
            self.closed.set()


async def _raw_request(port: int, body: dict[str, Any], rcvbuf: int = 4096) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()  # fmt: skip
    await asyncio.get_running_loop().sock_sendall(sock, head + data)
    return sock


async def test_a_client_that_stops_reading_is_cut_and_its_request_cancelled(gw) -> None:
    firehose = _Firehose()
    service = GatewayService(firehose, [gw.service.models[MODEL]], admission=AdmissionLimits(2))
    async with _served(service, write_timeout_s=0.5) as (_, server):
        sock = await _raw_request(server.port, LONG)  # and never read
        try:
            await asyncio.wait_for(firehose.closed.wait(), 60)
            await _eventually(lambda: service.admission.in_flight == 0, "the slot is freed")
            assert _refused_count(service, "slow_reader") == 1
        finally:
            sock.close()


async def test_a_grpc_client_that_stops_reading_is_cut_and_its_request_cancelled(gw) -> None:
    """gRPC's flow control fills the same way: the write that waits past the timeout ends
    the stream (DEADLINE_EXCEEDED for the client, should it ever read again)."""
    firehose = _Firehose()
    service = GatewayService(firehose, [gw.service.models[MODEL]], admission=AdmissionLimits(2))
    server = grpc_server(service, "127.0.0.1", 0, write_timeout_s=0.5)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            req = gateway_pb2.GenerateRequest(model=MODEL, prompt="Hi")
            call = gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=120)  # never read
            await asyncio.wait_for(firehose.closed.wait(), 60)
            await _eventually(lambda: service.admission.in_flight == 0, "the slot is freed")
            assert _refused_count(service, "slow_reader") == 1
            call.cancel()
    finally:
        await server.stop(None)


async def test_connections_past_the_cap_get_503_and_are_closed(gw, http) -> None:
    service = _service(gw, AdmissionLimits(4))
    async with _served(service, max_connections=2) as (base, server):
        loop = asyncio.get_running_loop()
        held = []
        for _ in range(2):
            s = socket.socket()
            s.setblocking(False)
            await loop.sock_connect(s, ("127.0.0.1", server.port))
            held.append(s)
        await _eventually(lambda: server.connections == 2, "both are accepted")
        try:
            async with aiohttp.ClientSession() as fresh:  # a new connection
                async with fresh.get(base + "/v1/models") as r:
                    assert r.status == 503 and r.headers["Retry-After"] == "1"
                    assert (await r.json())["error"]["code"] == "service_unavailable"
            assert _refused_count(service, "connections") == 1
        finally:
            for s in held:
                s.close()

        async def served() -> bool:
            async with aiohttp.ClientSession() as fresh, fresh.get(base + "/v1/models") as r:
                return r.status == 200

        await _until(served, "a connection is served once the others closed")


async def test_a_connection_that_never_finishes_its_request_head_is_closed(gw) -> None:
    """Slow loris: half a request head, then nothing. The connection is closed after the
    idle timeout, so such clients cannot hold the connection cap for ever."""
    service = _service(gw, AdmissionLimits(4))
    async with _served(service, max_connections=2, idle_timeout_s=0.5) as (_, server):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        silent_reader, silent_writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # no blank line
        await writer.drain()
        try:
            async with asyncio.timeout(10):
                assert await reader.read() == b""  # closed by the server, nothing answered
                assert await silent_reader.read() == b""  # never sent a byte: closed too
            await _eventually(lambda: server.connections == 0, "both are gone")
        finally:
            writer.close()
            silent_writer.close()


async def _until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(0.05)

"""The OpenAI-compatible HTTP edge (aiohttp).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or SSE when
``stream`` is true), ``GET /v1/models``, ``GET /health`` (200 when ready, else 503) and
``GET /metrics`` (Prometheus text). Every error, including 404/405/413 from aiohttp
itself, is OpenAI's JSON error object with a 4xx/5xx status.

A request's errors surface before any byte of the response: the handler waits for the
backend's first chunk before it sends the 200 and the SSE headers. A client that
disconnects cancels its handler (``handler_cancellation``), which closes the backend
stream and so aborts the request; so does one that stops reading: a stream write that waits
longer than the write timeout cuts the connection. Generations go through the service's
admission (429 with ``Retry-After`` / 503), and past ``max_connections`` open connections a
new one is answered 503 and closed (``_CappedSite``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from engine.errors import EngineError, ResourceExhaustedError
from engine.top_logprobs import TopLogprobs
from services.gateway import openai_responses as out
from services.gateway.admission import retry_after_header
from services.gateway.backend import BackendUnavailableError, GenerateChunk, GenerateInput, ServedBy
from services.gateway.openai_api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    check_prompt_size,
    decode_json_body,
    echo_text,
    from_engine_error,
    lookup,
    parse_chat,
    parse_completion,
    prepare_chat,
    prepare_completion,
)
from services.gateway.served_model import ServedModel
from services.gateway.service import GatewayService, new_request_id

log = structlog.get_logger(__name__)

SERVICE_KEY: web.AppKey[GatewayService] = web.AppKey("service", GatewayService)
MAX_BODY_KEY: web.AppKey[int] = web.AppKey("max_body_bytes", int)
WRITE_TIMEOUT_KEY: web.AppKey[float] = web.AppKey("write_timeout_s", float)
_CLIENT_CLOSED = 499  # nginx's code for "client closed request", for metrics only


class _StreamFailed(Exception):
    """The backend failed after the response started; the stream reports it in-band."""


class _SlowReader(Exception):
    """A stream write waited past the write timeout: the client stopped reading."""


def _json(obj: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=out.dumps(obj), status=status, content_type="application/json")


def error_response(err: ApiError) -> web.Response:
    resp = _json(err.to_dict(), err.status)
    if err.retry_after_s is not None:
        resp.headers["Retry-After"] = retry_after_header(err.retry_after_s)
    return resp


_AIOHTTP_ERRORS = {
    404: ("not_found", "Unknown URL {method} {path}."),
    405: ("method_not_allowed", "Method {method} is not allowed for {path}."),
    413: ("request_too_large", "The request body is larger than the limit of {limit} bytes."),
}


def _from_http_exception(exc: web.HTTPException, request: web.Request) -> ApiError:
    code, template = _AIOHTTP_ERRORS.get(exc.status, (None, exc.reason))
    message = template.format(
        method=request.method, path=request.path, limit=request.app[MAX_BODY_KEY]
    )
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    return ApiError(exc.status, message, kind, None, code)


def _endpoint(request: web.Request) -> str:
    # The route template, never the raw path: metric labels must stay a small set.
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def _edge(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Authentication, OpenAI-shaped errors and the request counter, for every route."""
    service = request.app[SERVICE_KEY]
    endpoint = _endpoint(request)
    try:
        if request.path.startswith("/v1/") and not service.authorized(
            request.headers.get("Authorization")
        ):
            raise ApiError(
                401,
                "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                "invalid_request_error",
                None,
                "invalid_api_key",
            )
        resp = await handler(request)
    except ApiError as err:
        resp = error_response(err)
    except (ResourceExhaustedError, BackendUnavailableError) as exc:  # refused by admission
        resp = error_response(from_engine_error(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            service.metrics.count_request(endpoint, exc.status)
            raise
        resp = error_response(_from_http_exception(exc, request))
    except asyncio.CancelledError:
        service.metrics.count_request(endpoint, _CLIENT_CLOSED)
        raise
    except Exception:
        log.exception("http_handler_failed", path=request.path)
        resp = error_response(ApiError(500, "Internal server error.", "server_error"))
    service.metrics.count_request(endpoint, resp.status)
    return resp


# -- handlers --------------------------------------------------------------------------------


async def _read_json(request: web.Request) -> object:
    try:
        data = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise _from_http_exception(exc, request) from None
    return decode_json_body(data)


def _check_size(
    service: GatewayService, req: CompletionRequest | ChatRequest, model: ServedModel
) -> None:
    try:
        check_prompt_size(req, model)
    except ApiError:
        service.metrics.count_refusal("too_long")
        raise


@asynccontextmanager
async def _admitted(request: web.Request, rid: str) -> AsyncIterator[GatewayService]:
    """The request's log context and admission slot, held while the body runs."""
    service = request.app[SERVICE_KEY]
    key = service.rate_key(request.headers.get("Authorization"), request.remote or "")
    with structlog.contextvars.bound_contextvars(request_id=rid):
        async with service.admitted(key):
            yield service


def _check_serving(service: GatewayService) -> None:
    if service.draining:
        raise ApiError(
            503,
            "The server is shutting down; retry on another replica.",
            "server_error",
            None,
            "service_unavailable",
        )


async def _chunks(
    stream: AsyncIterator[GenerateChunk], prompt_param: str
) -> AsyncIterator[GenerateChunk]:
    """``stream``'s chunks up to the last one. Errors before the first chunk raise
    ``ApiError``; later ones raise ``_StreamFailed`` (the response has started by then)."""
    started = False
    try:
        async for chunk in stream:
            started = True
            yield chunk
            if chunk.finish_reason is not None:
                return
    except EngineError as exc:
        if not started:
            raise from_engine_error(exc, prompt_param) from None
        raise _StreamFailed(str(exc)) from exc
    except Exception as exc:
        if not started:
            raise  # a server fault before the response started: the middleware's 500
        log.exception("backend_stream_failed")
        raise _StreamFailed(f"internal error ({type(exc).__name__})") from exc
    raise _StreamFailed("the backend ended the stream without a finish reason")


@dataclass
class _Result:
    """A whole generation, for non-streaming responses."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    served_by: ServedBy = field(default_factory=ServedBy)


async def _collect(stream: AsyncIterator[GenerateChunk], prompt_param: str) -> _Result:
    r = _Result()
    parts = []
    async for c in _chunks(stream, prompt_param):
        parts.append(c.text_delta)
        r.token_ids.extend(c.token_ids)
        r.logprobs.extend(c.logprobs)
        r.top_logprobs.extend(c.top_logprobs)
        r.finish_reason = c.finish_reason
        r.usage = out.usage(c.prompt_tokens, c.completion_tokens, c.cached_tokens)
        r.served_by = c.served_by
    r.text = "".join(parts)
    return r


async def _sse_response(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies must not buffer a token stream
        }
    )
    await resp.prepare(request)
    return resp


class _Relay:
    """Streams one generation as SSE, started only once the first chunk is in hand."""

    def __init__(
        self,
        request: web.Request,
        stream: AsyncIterator[GenerateChunk],
        prompt_param: str,
    ) -> None:
        self.request = request
        self.write_timeout_s = request.app[WRITE_TIMEOUT_KEY]
        self.chunks = aiter(_chunks(stream, prompt_param))
        self.first: GenerateChunk | None = None
        self.resp: web.StreamResponse | None = None

    async def start(self) -> None:
        """Wait for the first chunk (errors raise ``ApiError``), then send the headers."""
        self.first = await anext(self.chunks)
        self.resp = await _sse_response(self.request)

    async def all(self) -> AsyncIterator[GenerateChunk]:
        """Every chunk, the first included, up to the last."""
        assert self.first is not None
        yield self.first
        async for c in self.chunks:
            yield c

    async def send(self, obj: dict[str, Any] | bytes) -> None:
        assert self.resp is not None
        await self._timed(self.resp.write(obj if isinstance(obj, bytes) else out.sse(obj)))

    async def finish(self) -> web.StreamResponse:
        assert self.resp is not None
        await self._timed(self.resp.write_eof())
        return self.resp

    async def _timed(self, write: Awaitable[None]) -> None:
        # A write waits only when the socket's buffers are full: the client is not reading.
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await write
        except TimeoutError:
            raise _SlowReader from None

    def cut(self) -> web.StreamResponse:
        """Drop the connection of a client that stopped reading (its unsent bytes too)."""
        assert self.resp is not None
        if self.request.transport is not None:
            self.request.transport.abort()
        return self.resp


async def _run_stream(
    relay: _Relay,
    frames: Callable[[GenerateChunk], list[dict[str, Any]]],
    usage_frame: Callable[[GenerateChunk], dict[str, Any]] | None,
    intro: Sequence[dict[str, Any]] = (),
    started: Callable[[], None] | None = None,
) -> web.StreamResponse:
    """Send ``intro``, then each chunk's ``frames``, the usage frame, and ``[DONE]``;
    ``started`` runs once the first chunk's frames are written (e.g. a log line, which
    should not delay the first token)."""
    last: GenerateChunk | None = None
    try:
        try:
            for frame in intro:
                await relay.send(frame)
            async for c in relay.all():
                first = last is None
                last = c
                for frame in frames(c):
                    await relay.send(frame)
                if first and started is not None:
                    started()
            if usage_frame is not None and last is not None:
                await relay.send(usage_frame(last))
        except _StreamFailed as exc:
            log.warning("stream_failed", error=str(exc))
            await relay.send(out.stream_error(str(exc)))
        await relay.send(out.SSE_DONE)
        return await relay.finish()
    except ConnectionResetError:
        # The client left between two writes (the handler was not cancelled first).
        log.info("client_disconnected")
        assert relay.resp is not None
        return relay.resp
    except _SlowReader:
        log.warning("slow_reader_cut", write_timeout_s=relay.write_timeout_s)
        relay.request.app[SERVICE_KEY].metrics.count_refusal("slow_reader")
        return relay.cut()


async def completions(request: web.Request) -> web.StreamResponse:
    received_at = time.monotonic()
    service = request.app[SERVICE_KEY]
    req = parse_completion(await _read_json(request), service.models)
    _check_serving(service)
    model = lookup(service.models, req.model)
    _check_size(service, req, model)
    rid = new_request_id("cmpl")
    async with _admitted(request, rid):
        inp = await service.prepare(prepare_completion, req, model, rid, service.limits)
        created = int(time.time())
        tok = model.tokenizer
        echo = echo_text(req, model)
        stream = service.generate(inp, received_at)
        async with aclosing(stream):  # type: ignore[type-var]
            if not req.stream:
                r = await _collect_or_500(stream, "prompt")
                lp = (
                    out.completion_logprobs(tok, r.token_ids, r.logprobs, len(echo), r.top_logprobs)
                    if inp.params.logprobs
                    else None
                )
                ext = out.extension(r.served_by)
                text, reason = echo + r.text, r.finish_reason
                return _json(
                    out.completion(rid, created, model.name, text, reason, lp, r.usage, ext)
                )
            offset = 0

            def frames(c: GenerateChunk) -> list[dict[str, Any]]:
                nonlocal offset, echo
                text, echo = echo + c.text_delta, ""  # the echoed prompt leads the first frame
                lp = None
                if inp.params.logprobs:
                    lp = out.completion_logprobs(
                        tok, c.token_ids, c.logprobs, offset + len(text) - len(c.text_delta),
                        c.top_logprobs,
                    )  # fmt: skip
                offset += len(text)
                if not text and c.finish_reason is None and lp is None:
                    return []
                return [out.completion(rid, created, model.name, text, c.finish_reason, lp)]

            relay = _Relay(request, stream, "prompt")
            await relay.start()
            return await _run_stream(
                relay,
                frames,
                _usage_frame(rid, created, inp, "text_completion", req),
                started=lambda: log.info(
                    "completion_started", prompt_tokens=len(inp.prompt_token_ids)
                ),
            )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    received_at = time.monotonic()
    service = request.app[SERVICE_KEY]
    req = parse_chat(await _read_json(request), service.models)
    _check_serving(service)
    model = lookup(service.models, req.model)
    _check_size(service, req, model)
    rid = new_request_id("chatcmpl")
    async with _admitted(request, rid):
        inp = await service.prepare(prepare_chat, req, model, rid, service.limits)
        created = int(time.time())
        tok = model.tokenizer
        stream = service.generate(inp, received_at)
        async with aclosing(stream):  # type: ignore[type-var]
            if not req.stream:
                r = await _collect_or_500(stream, "messages")
                lp = (
                    out.chat_logprobs(tok, r.token_ids, r.logprobs, r.top_logprobs)
                    if inp.params.logprobs
                    else None
                )
                ext = out.extension(r.served_by)
                return _json(
                    out.chat_completion(
                        rid, created, model.name, r.text, r.finish_reason, lp, r.usage, ext
                    )
                )

            def frames(c: GenerateChunk) -> list[dict[str, Any]]:
                result = []
                lp = (
                    out.chat_logprobs(tok, c.token_ids, c.logprobs, c.top_logprobs)
                    if inp.params.logprobs
                    else None
                )
                if c.text_delta or lp is not None:
                    delta = {"content": c.text_delta}
                    result.append(out.chat_chunk(rid, created, model.name, delta, None, lp))
                if c.finish_reason is not None:
                    result.append(out.chat_chunk(rid, created, model.name, {}, c.finish_reason))
                return result

            relay = _Relay(request, stream, "messages")
            await relay.start()
            role = {"role": "assistant", "content": ""}
            return await _run_stream(
                relay,
                frames,
                _usage_frame(rid, created, inp, "chat.completion.chunk", req),
                [out.chat_chunk(rid, created, model.name, role, None)],
                started=lambda: log.info(
                    "chat_completion_started", prompt_tokens=len(inp.prompt_token_ids)
                ),
            )


def _usage_frame(
    rid: str, created: int, inp: GenerateInput, obj: str, req: CompletionRequest | ChatRequest
) -> Callable[[GenerateChunk], dict[str, Any]] | None:
    if not req.include_usage:
        return None

    def frame(last: GenerateChunk) -> dict[str, Any]:
        usage = out.usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
        return out.usage_chunk(rid, created, inp.model, obj, usage, out.extension(last.served_by))

    return frame


async def _collect_or_500(stream: AsyncIterator[GenerateChunk], prompt_param: str) -> _Result:
    try:
        r = await _collect(stream, prompt_param)
    except _StreamFailed as exc:
        raise ApiError(500, f"Generation failed: {exc}", "server_error") from exc
    if r.finish_reason == "error":
        raise ApiError(500, "Generation failed in the backend.", "server_error")
    return r


async def models(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    data = [
        {
            "id": m.name,
            "object": "model",
            "created": m.created,
            "owned_by": m.owned_by,
            "max_model_len": m.max_model_len,
        }
        for m in sorted(service.models.values(), key=lambda m: m.name)
    ]
    return _json({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    if await service.ready():
        return _json({"status": "ok"})
    return _json({"status": "draining" if service.draining else "unavailable"}, 503)


async def metrics(request: web.Request) -> web.Response:
    service = request.app[SERVICE_KEY]
    return web.Response(
        body=service.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


# -- the app and its server ------------------------------------------------------------------


def create_app(
    service: GatewayService, *, max_body_bytes: int = 4 << 20, write_timeout_s: float = 30.0
) -> web.Application:
    """The aiohttp application; bodies over ``max_body_bytes`` get 413, and a stream whose
    client takes no write for ``write_timeout_s`` is cut."""
    app = web.Application(middlewares=[_edge], client_max_size=max_body_bytes)
    app[SERVICE_KEY] = service
    app[MAX_BODY_KEY] = max_body_bytes
    app[WRITE_TIMEOUT_KEY] = write_timeout_s
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


_REFUSER_LINGER_S = 2.0


class _Refuser(asyncio.Protocol):
    """A connection past the cap: answered 503 at once, then closed once the client has
    finished sending (or after a moment), so closing does not reset the answer away."""

    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        err = ApiError(
            503,
            f"The server has its limit of {self.max_connections} open connections; retry later.",
            "server_error",
            None,
            "service_unavailable",
        )
        body = out.dumps(err.to_dict())
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        )
        transport.write(head.encode() + body)
        transport.write_eof()
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(_REFUSER_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request is not read: it was answered already

    def eof_received(self) -> bool:
        return False  # close now

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()


class _CappedSite(web.BaseSite):
    """A TCP site that hands connections past ``max_connections`` to ``_Refuser``."""

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        max_connections: int,
        on_refused: Callable[[], None],
    ) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._max_connections = max_connections
        self._on_refused = on_refused
        self.port = port

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.port}"

    def _protocol(self) -> asyncio.BaseProtocol:
        server = self._runner.server
        assert server is not None
        if len(server.connections) >= self._max_connections:
            self._on_refused()
            return _Refuser(self._max_connections)
        return server()

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._protocol, self._host, self._port)
        self.port = self._server.sockets[0].getsockname()[1]  # what port 0 became


class HttpServer:
    """Runs an app on ``host:port`` (0: a free port, see ``port``).

    At most ``max_connections`` connections are served at once; one more is answered 503
    and closed. ``stop`` stops listening, lets running handlers finish for up to
    ``drain_timeout_s``, then cancels them (which aborts their generations).
    """

    def __init__(
        self,
        app: web.Application,
        host: str,
        port: int,
        drain_timeout_s: float,
        *,
        max_connections: int = 512,
    ):
        self._runner = web.AppRunner(
            app,
            handler_cancellation=True,
            shutdown_timeout=drain_timeout_s,
            access_log=None,
        )
        self._metrics = app[SERVICE_KEY].metrics
        self._host = host
        self._port = port
        self._max_connections = max_connections
        self.port = port

    async def start(self) -> int:
        await self._runner.setup()
        site = _CappedSite(
            self._runner,
            self._host,
            self._port,
            self._max_connections,
            lambda: self._metrics.count_refusal("connections"),
        )
        await site.start()
        self.port = site.port
        return self.port

    @property
    def connections(self) -> int:
        """HTTP connections open now (those refused past the cap not counted)."""
        server = self._runner.server
        return 0 if server is None else len(server.connections)

    async def stop(self) -> None:
        await self._runner.cleanup()

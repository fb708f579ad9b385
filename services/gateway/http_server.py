"""The OpenAI-compatible HTTP edge (aiohttp).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or SSE when
``stream`` is true), ``GET /v1/models``, ``GET /health`` (200 when ready, else 503) and
``GET /metrics`` (Prometheus text). Every error, including 404/405/413 from aiohttp
itself, is OpenAI's JSON error object with a 4xx/5xx status.

Both generation routes take one request path (``_generate``); what differs between them is
``openai_endpoints`` (parsing, prompt building, response and chunk shapes), and
``http_relay`` answers whole or streams. A request's errors surface before any byte of the
response: the handler waits for the backend's first chunk before it sends the 200 and the
SSE headers. A client that
disconnects cancels its handler (``handler_cancellation``), which closes the backend
stream and so aborts the request; so does one that stops reading: a stream write that waits
longer than the write timeout cuts the connection. Generations go through the service's
admission (429 with ``Retry-After`` / 503), and past ``max_connections`` open connections a
new one is answered 503 and closed (``_CappedSite``).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from engine.errors import ResourceExhaustedError
from services.gateway import openai_responses as out
from services.gateway.admission import retry_after_header
from services.gateway.backend import BackendUnavailableError, GenerateInput
from services.gateway.choices import choice_inputs, merged
from services.gateway.http_relay import Choice, SseRelay, collect
from services.gateway.openai_api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    bad_request,
    check_prompt_size,
    decode_json_body,
    from_engine_error,
    lookup,
)
from services.gateway.openai_endpoints import CHAT_COMPLETIONS, COMPLETIONS, Endpoint, Reply
from services.gateway.served_model import ServedModel
from services.gateway.service import GatewayService, new_request_id

log = structlog.get_logger(__name__)

SERVICE_KEY: web.AppKey[GatewayService] = web.AppKey("service", GatewayService)
MAX_BODY_KEY: web.AppKey[int] = web.AppKey("max_body_bytes", int)
WRITE_TIMEOUT_KEY: web.AppKey[float] = web.AppKey("write_timeout_s", float)
_CLIENT_CLOSED = 499  # nginx's code for "client closed request", for metrics only


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
async def _admitted(request: web.Request, rid: str, n: int) -> AsyncIterator[GatewayService]:
    """The request's log context and its ``n`` choices' admission slots, held while the
    body runs."""
    service = request.app[SERVICE_KEY]
    key = service.rate_key(request.headers.get("Authorization"), request.remote or "")
    with structlog.contextvars.bound_contextvars(request_id=rid):
        async with service.admitted(key, n):
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


def _check_choices(service: GatewayService, n: int) -> None:
    """``n`` choices hold ``n`` admission slots: more than the cap could never start."""
    cap = service.admission.limits.max_concurrent
    if n > cap:
        raise bad_request(f"'n'={n} exceeds this server's {cap} concurrent generations.", "n")


async def _generate(endpoint: Endpoint[Any], request: web.Request) -> web.StreamResponse:
    """The request path of both generation endpoints (``openai_endpoints`` holds what
    differs): parse -> draining, ``n``, model and size checks -> admission -> template and
    tokenize off the loop -> ``n`` generations -> one whole response or an SSE stream."""
    received_at = time.monotonic()
    service = request.app[SERVICE_KEY]
    req = endpoint.parse(await _read_json(request), service.models)
    _check_serving(service)
    _check_choices(service, req.n)
    model = lookup(service.models, req.model)
    _check_size(service, req, model)
    rid = new_request_id(endpoint.id_prefix)
    async with _admitted(request, rid, req.n):
        inp = await service.prepare(endpoint.prepare, req, model, rid, service.limits)
        shape = endpoint.shape(Reply(rid, int(time.time()), model, inp, req))
        stream = _generations(service, inp, req.n, received_at)
        async with aclosing(stream):  # type: ignore[type-var]
            if not req.stream:
                return _json(shape.whole(await collect(stream, req.n, endpoint.prompt_param)))
            relay = SseRelay(
                request,
                stream,
                endpoint.prompt_param,
                request.app[WRITE_TIMEOUT_KEY],
                lambda: service.metrics.count_refusal("slow_reader"),
            )
            await relay.start()
            prompt_tokens = len(inp.prompt_token_ids)
            return await relay.run(
                shape, lambda: log.info(endpoint.started_event, prompt_tokens=prompt_tokens)
            )


def _generations(
    service: GatewayService, inp: GenerateInput, n: int, received_at: float
) -> AsyncIterator[Choice]:
    """The request's ``n`` choices' chunks, merged (``choices.merged``)."""
    return merged(
        [functools.partial(service.generate, c, received_at) for c in choice_inputs(inp, n)]
    )


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
    app.router.add_post("/v1/completions", functools.partial(_generate, COMPLETIONS))
    app.router.add_post("/v1/chat/completions", functools.partial(_generate, CHAT_COMPLETIONS))
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
    and closed. A connection with no request under way is closed after ``idle_timeout_s``
    (whether it sent nothing, half a request head, or is between requests). ``stop`` stops
    listening, lets running handlers finish for up to ``drain_timeout_s``, then cancels them
    (which aborts their generations).
    """

    def __init__(
        self,
        app: web.Application,
        host: str,
        port: int,
        drain_timeout_s: float,
        *,
        max_connections: int = 512,
        idle_timeout_s: float = 15.0,
    ):
        self._runner = web.AppRunner(
            app,
            handler_cancellation=True,
            shutdown_timeout=drain_timeout_s,
            access_log=None,
            # aiohttp's keep-alive timer runs whenever no request is under way: it also
            # closes a connection that sends nothing, or half a request head, for this long.
            keepalive_timeout=idle_timeout_s,
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

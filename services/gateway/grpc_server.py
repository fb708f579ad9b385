"""The gRPC edge: ``pdserve.v1.Gateway`` (Generate, ListModels), on the shell's server
(with ``grpc.health.v1`` and reflection).

Generate: authenticate -> resolve model -> size check -> admission (the service's, as for
HTTP: RESOURCE_EXHAUSTED with ``retry-after-ms``, UNAVAILABLE while draining) ->
template/tokenize off the event loop and check (``grpc_convert``) -> backend stream ->
events. Errors before the first event end the call with a status
(INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE, UNAUTHENTICATED); a failure
after it ends the stream with a FINISH_REASON_ERROR event. A client cancel or deadline
cancels the servicer task, which closes the backend stream and aborts the request.

A request whose bytes do not decode (e.g. invalid UTF-8 in a string field) is answered
INVALID_ARGUMENT rather than grpc's default INTERNAL: the method handlers are registered
with a deserializer that hands the decode error to the servicer.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError

from engine.errors import (
    CapacityError,
    EngineError,
    InvalidRequestError,
    ResourceExhaustedError,
)
from engine.sampling_params import SamplingParams
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common import process
from services.gateway import grpc_convert as conv
from services.gateway.admission import retry_after_s
from services.gateway.backend import BackendUnavailableError, GenerateChunk, GenerateInput
from services.gateway.choices import to_last
from services.gateway.served_model import ContextLengthError, ServedModel
from services.gateway.service import GatewayService, new_request_id

log = structlog.get_logger(__name__)

SERVICE_NAME = "pdserve.v1.Gateway"


@dataclass(frozen=True)
class _Undecodable:
    """Stands in for a request message whose bytes failed to parse."""

    error: str


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return _Undecodable(str(exc) or "malformed protobuf")

    return deserialize


class _Status(Exception):
    """End the call with this status (before any event was sent)."""

    def __init__(
        self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.trailing = trailing


def _status_for(exc: EngineError) -> _Status:
    if isinstance(exc, InvalidRequestError | CapacityError):
        return _Status(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, ResourceExhaustedError):
        trailing = (("retry-after-ms", str(math.ceil(retry_after_s(exc) * 1000))),)
        return _Status(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), trailing)
    if isinstance(exc, BackendUnavailableError):
        return _Status(grpc.StatusCode.UNAVAILABLE, str(exc))
    return _Status(grpc.StatusCode.INTERNAL, f"generation failed: {exc}")


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """``pdserve.v1.Gateway`` over a ``GatewayService``."""

    def __init__(self, service: GatewayService, *, write_timeout_s: float = 30.0) -> None:
        self.service = service
        self.write_timeout_s = write_timeout_s

    def _check_auth(self, context: grpc.aio.ServicerContext) -> None:
        md = dict(context.invocation_metadata() or ())
        if not self.service.authorized(md.get("authorization")):
            raise _Status(
                grpc.StatusCode.UNAUTHENTICATED,
                "invalid or missing API key: send metadata 'authorization: Bearer <key>'",
            )

    def _model(self, name: str) -> ServedModel:
        models = self.service.models
        if not name:
            if len(models) != 1:
                raise _Status(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"model is required: this gateway serves {sorted(models)}",
                )
            return next(iter(models.values()))
        model = models.get(name)
        if model is None:
            raise _Status(
                grpc.StatusCode.NOT_FOUND, f"model {name!r} is not served here: {sorted(models)}"
            )
        return model

    async def Generate(
        self, request: gateway_pb2.GenerateRequest | _Undecodable, context: Any
    ) -> None:
        received_at = time.monotonic()
        outcome = grpc.StatusCode.OK
        try:
            async with aclosing(self._generate(request, context, received_at)) as events:
                async for ev in events:
                    await self._write(context, ev)
        except (_Status, ResourceExhaustedError, BackendUnavailableError) as exc:
            # admission's refusals come as the backends' errors do
            st = exc if isinstance(exc, _Status) else _status_for(exc)
            outcome = st.code
            if st.trailing:
                context.set_trailing_metadata(st.trailing)
            await context.abort(st.code, st.details)
        except Exception:
            log.exception("grpc_generate_failed")
            outcome = grpc.StatusCode.INTERNAL
            await context.abort(outcome, "internal error")
        except BaseException:  # cancelled by the client, its deadline or a server stop
            outcome = grpc.StatusCode.CANCELLED
            raise
        finally:
            self.service.metrics.count_request("grpc.Generate", outcome.name)

    async def _write(self, context: Any, ev: gateway_pb2.GenerateEvent) -> None:
        """Send ``ev``; a client that takes nothing for ``write_timeout_s`` (its flow-control
        window stays full) is cut, which ends its request and frees its slot."""
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await context.write(ev)
        except TimeoutError:
            self.service.metrics.count_refusal("slow_reader")
            log.warning("slow_reader_cut", write_timeout_s=self.write_timeout_s)
            raise _Status(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the client read nothing for {self.write_timeout_s:g} s: the stream is cut",
            ) from None

    async def _generate(
        self, request: gateway_pb2.GenerateRequest | _Undecodable, context: Any, received_at: float
    ) -> AsyncIterator[gateway_pb2.GenerateEvent]:
        if isinstance(request, _Undecodable):
            raise _Status(
                grpc.StatusCode.INVALID_ARGUMENT, f"the request could not be decoded: {request}"
            )
        self._check_auth(context)
        if self.service.draining:
            raise _Status(grpc.StatusCode.UNAVAILABLE, "the gateway is shutting down; retry")
        model = self._model(request.model)
        try:
            rid = conv.check_request_id(request.request_id) or new_request_id("gen")
            params = conv.sampling_from_proto(request.sampling)
            conv.check_prompt_size(request, model, params)
        except InvalidRequestError as exc:
            if isinstance(exc, ContextLengthError):
                self.service.metrics.count_refusal("too_long")
            raise _Status(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        md = dict(context.invocation_metadata() or ())
        key = self.service.rate_key(md.get("authorization"), _peer_host(context.peer()))
        with structlog.contextvars.bound_contextvars(request_id=rid):
            async with (
                self.service.admitted(key),
                aclosing(self._run(request, model, rid, params, received_at)) as events,
            ):
                async for ev in events:
                    yield ev

    async def _run(
        self,
        request: gateway_pb2.GenerateRequest,
        model: ServedModel,
        rid: str,
        params: SamplingParams,
        received_at: float,
    ) -> AsyncIterator[gateway_pb2.GenerateEvent]:
        try:
            ids = await self.service.prepare(conv.prompt_ids, request, model)
            model.check_request(params, len(ids))
        except InvalidRequestError as exc:
            raise _Status(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        inp = GenerateInput(rid, ids, params, model.name)
        with_ids = request.return_token_ids or params.logprobs
        stream = self.service.generate(inp, received_at)
        async with aclosing(stream):  # type: ignore[type-var]
            chunks = to_last(stream)
            try:
                chunk = await anext(chunks)
            except EngineError as exc:  # StreamEndedEarly too: the backend sent nothing
                raise _status_for(exc) from None
            first_at = time.monotonic()
            logged = False
            async for ev in self._relay(rid, chunk, chunks, with_ids, received_at, first_at):
                yield ev
                if not logged:  # after the first event went out: a log write is no
                    # business of the first token's delivery (it may wait for the GIL)
                    log.info("grpc_generate_started", prompt_tokens=len(ids))
                    logged = True

    async def _relay(
        self,
        rid: str,
        chunk: GenerateChunk,
        stream: AsyncIterator[GenerateChunk],
        with_ids: bool,
        received_at: float,
        first_at: float,
    ) -> AsyncIterator[gateway_pb2.GenerateEvent]:
        while True:
            ev = conv.event(rid, chunk, with_token_ids=with_ids)
            if chunk.finish_reason is not None:
                ev.timing.first_token_seconds = first_at - received_at
                ev.timing.total_seconds = time.monotonic() - received_at
                yield ev
                return
            yield ev
            try:
                chunk = await anext(stream)  # to_last's: it raises if the stream ends early
            except Exception as exc:
                log.warning("grpc_stream_failed", error=str(exc))
                yield gateway_pb2.GenerateEvent(
                    request_id=rid,
                    finish_reason=common_pb2.FINISH_REASON_ERROR,
                    error_message=str(exc) or type(exc).__name__,
                    usage=common_pb2.Usage(
                        prompt_tokens=chunk.prompt_tokens,
                        completion_tokens=chunk.completion_tokens,
                        cached_tokens=chunk.cached_tokens,
                    ),
                    timing=common_pb2.Timing(
                        first_token_seconds=first_at - received_at,
                        total_seconds=time.monotonic() - received_at,
                    ),
                )
                return

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest | _Undecodable, context: Any
    ) -> gateway_pb2.ListModelsReply:
        outcome = grpc.StatusCode.OK
        try:
            self._check_auth(context)
            models = sorted(self.service.models.values(), key=lambda m: m.name)
            return gateway_pb2.ListModelsReply(models=[conv.model_card(m) for m in models])
        except _Status as st:
            outcome = st.code
            await context.abort(st.code, st.details)
            raise  # unreachable: abort raises
        finally:
            self.service.metrics.count_request("grpc.ListModels", outcome.name)


def _register(server: grpc.aio.Server, servicer: GatewayServicer) -> None:
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=_lenient(gateway_pb2.GenerateRequest.FromString),
            response_serializer=gateway_pb2.GenerateEvent.SerializeToString,
        ),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels,
            request_deserializer=_lenient(gateway_pb2.ListModelsRequest.FromString),
            response_serializer=gateway_pb2.ListModelsReply.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def grpc_server(
    service: GatewayService,
    host: str,
    port: int,
    *,
    max_message_bytes: int = 4 << 20,
    write_timeout_s: float = 30.0,
) -> process.GrpcServer:
    """The shell's gRPC server on ``host:port`` serving ``pdserve.v1.Gateway`` for
    ``service`` (health and reflection included; not started yet); a stream whose client
    takes no event for ``write_timeout_s`` is cut."""
    server = process.GrpcServer([SERVICE_NAME], host, port, max_message_bytes=max_message_bytes)
    _register(server.server, GatewayServicer(service, write_timeout_s=write_timeout_s))
    return server


def _peer_host(peer: str) -> str:
    """``ipv4:127.0.0.1:5000`` -> ``ipv4:127.0.0.1``: a client's address, whatever its port."""
    host, _, port = peer.rpartition(":")
    return host if host and port.isdigit() else peer

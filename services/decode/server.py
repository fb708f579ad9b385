"""The decode worker's gRPC edge: continuous batching over a paged KV cache.

Request lifecycle (each stage a queue):
  received -> blocks reserved in the registered pool (admission by free KV blocks)
  -> Prefill RPC to the chosen prefill worker, which writes the prompt's KV straight into
     those blocks -> joined to the running batch with its first token -> tokens streamed
     until a stop condition -> blocks freed (finish, error or cancel).
Without a prefill address (colocated mode, or a short prompt under the local threshold)
the prompt is prefilled here by the same engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import structlog

from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError
from engine.output_processor import RequestOutput
from engine.sampling_params import SamplingParams
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.common import cluster_auth, metrics
from services.common.convert import finish_to_proto, handle_to_proto, sampling_from_proto, usage
from services.common.grpc_errors import abort_with, status_for
from transfer.handle import MemoryRegionHandle

log = structlog.get_logger(__name__)

PREFILL_DEADLINE_S = 30.0
# After a failed or cancelled prefill, bytes of that job may still land for a moment: the
# reserved blocks are held this long past the writer's deadline before reuse (KV lease).
LEASE_GRACE_S = 1.0


class UpstreamError(Exception):
    """A call this worker made failed; the client gets that call's status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(
        self,
        aengine: AsyncEngine,
        region: MemoryRegionHandle | None,
        *,
        role: str = "decode",
        local_prefill_max_tokens: int = 0,
        prefill_deadline_s: float = PREFILL_DEADLINE_S,
        worker_id: str = "",
    ) -> None:
        self.aengine = aengine
        self.region = region
        self.role = role
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.prefill_deadline_s = prefill_deadline_s
        self.worker_id = worker_id
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.inflight = 0
        self.kv_bytes_received = 0
        if region is not None:  # export the series at 0 before the first transfer
            metrics.TRANSFER_BYTES.labels(role, region.transport)

    def _prefill_stub(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = cluster_auth.channel(address)
            self._channels[address] = ch
        return worker_pb2_grpc.PrefillWorkerStub(ch)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()

    async def Generate(
        self, request: worker_pb2.DecodeGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeEvent]:
        arrival = time.monotonic()
        rid = request.request_id
        structlog.contextvars.bind_contextvars(request_id=rid)
        self.inflight += 1
        try:
            async for ev in self._generate(request, context, arrival):
                yield ev
        finally:
            self.inflight -= 1
            structlog.contextvars.unbind_contextvars("request_id")

    async def _generate(
        self,
        request: worker_pb2.DecodeGenerateRequest,
        context: grpc.aio.ServicerContext,
        arrival: float,
    ) -> AsyncIterator[worker_pb2.DecodeEvent]:
        rid = request.request_id
        try:
            if not rid:
                raise InvalidRequestError("request_id is required")
            params = sampling_from_proto(request.sampling)
            ids = list(request.prompt_token_ids)
            if not ids:
                raise InvalidRequestError("prompt_token_ids is empty")
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return

        remote = bool(request.prefill_address) and self.region is not None
        if remote and len(ids) <= self.local_prefill_max_tokens:
            remote = False  # conditional disaggregation: a short prompt is cheaper here
        kv_bytes = 0
        try:
            if remote:
                stream, kv_bytes = await self._remote_prefill(request, ids, params)
            else:
                stream = self.aengine.generate(rid, ids, params)
            first = True
            last = arrival
            async for out in stream:
                now = time.monotonic()
                if first:
                    metrics.TTFT.labels(self.role).observe(now - arrival)
                    first = False
                else:
                    metrics.ITL.labels(self.role).observe(now - last)
                last = now
                yield self._event(out, kv_bytes, request.prefill_worker_id if remote else "")
                if out.finished:
                    metrics.E2E.labels(self.role).observe(now - arrival)
                    metrics.REQUESTS.labels(self.role, out.finish_reason or "").inc()
        except asyncio.CancelledError:
            raise  # client went away: AsyncEngine aborts the request and frees its blocks
        except UpstreamError as e:
            metrics.ERRORS.labels(self.role, e.code.name).inc()
            await context.abort(e.code, e.message)
        except Exception as e:
            metrics.ERRORS.labels(self.role, status_for(e).name).inc()
            if status_for(e) is grpc.StatusCode.INTERNAL:
                log.exception("generate_failed")
            await abort_with(context, e)

    async def _remote_prefill(
        self,
        request: worker_pb2.DecodeGenerateRequest,
        ids: list[int],
        params: SamplingParams,
    ) -> tuple[AsyncIterator[RequestOutput], int]:
        assert self.region is not None
        rid = request.request_id
        blocks = await self.aengine.reserve(rid, ids, params)
        stub = self._prefill_stub(request.prefill_address)
        preq = worker_pb2.PrefillRequest(
            request_id=rid,
            prompt_token_ids=ids,
            sampling=request.sampling,
            deadline_ms=int(self.prefill_deadline_s * 1000),
            decode_worker_id=self.worker_id,
            placement_token=request.placement_token,
            kv_destination=worker_pb2.KVDestination(
                region=handle_to_proto(self.region), block_ids=blocks
            ),
        )
        try:
            reply = await stub.Prefill(preq, timeout=self.prefill_deadline_s)
        except BaseException as e:
            self._release_later(rid)
            if isinstance(e, grpc.aio.AioRpcError):
                raise UpstreamError(e.code(), f"prefill failed: {e.details()}") from e
            raise
        self.kv_bytes_received += reply.kv_transfer_bytes
        metrics.TRANSFER_BYTES.labels(self.role, self.region.transport).inc(reply.kv_transfer_bytes)
        return self.aengine.join_prefilled(
            rid, reply.first_token_id, reply.first_token_logprob
        ), reply.kv_transfer_bytes

    def _release_later(self, rid: str) -> None:
        async def release() -> None:
            await asyncio.sleep(LEASE_GRACE_S)
            await self.aengine.release(rid)

        asyncio.get_running_loop().create_task(release())

    def _event(self, out: RequestOutput, kv_bytes: int, prefill_id: str) -> worker_pb2.DecodeEvent:
        ev = worker_pb2.DecodeEvent(
            token_ids=list(out.new_token_ids),
            logprobs=list(out.new_logprobs),
            text=out.text_delta,
            produced_unix_ns=time.time_ns(),
        )
        if out.finished:
            ev.finish_reason = finish_to_proto(out.finish_reason)
            ev.usage.CopyFrom(usage(out))
            ev.kv_transfer_bytes = kv_bytes
            ev.prefill_worker_id = prefill_id
        return ev

"""The decode worker's gRPC edge: continuous batching over a paged KV cache.

Request lifecycle (each stage a queue):
  received -> blocks reserved in the registered pool (admission by free KV blocks; the
     blocks of the longest prefix this pool's prefix cache holds are reused: earlier
     requests' prompts and outputs, so a conversation's next turn finds the last one's)
  -> Prefill RPC to the chosen prefill worker, which writes the KV of the rest of the
     prompt straight into those blocks (``num_present_tokens``: what is already here)
  -> joined to the running batch with its first token -> tokens streamed until a stop
     condition -> blocks freed (finish, error or cancel; full ones stay cached).
Exactly when the request names no prefill worker (or on a colocated worker) the prompt is
prefilled here by the same engine: the scheduler alone decides local vs remote prefill.
A migrated request (``resume_token_ids``) has prompt + those tokens prefilled the same way
and continues after them.

The reservation, the Prefill call's outcome and the KV fence are ``KVReceiver``'s
(``services/decode/kv_receiver.py``); this module converts protobuf at the edge.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import structlog

from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError
from engine.llm_engine import Reservation
from engine.output_processor import RequestOutput
from engine.sampling_params import SamplingParams
from kvstore.prefix import loaded_prefix
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.common import cluster_auth, metrics
from services.common.channels import ChannelPool
from services.common.convert import (
    FAILED_WORKER_KEY,
    abort_with,
    finish_to_proto,
    handle_to_proto,
    kv_fenced,
    sampling_from_proto,
    status_for,
    top_logprobs_from_proto,
    top_logprobs_to_proto,
    usage,
)
from services.common.kv_store import StoreLink
from services.decode.kv_receiver import KVReceiver, Prefilled, PrefillFailed
from transfer.handle import MemoryRegionHandle

log = structlog.get_logger(__name__)


class UpstreamError(Exception):
    """A call this worker made failed; the client gets that call's status, and the trailing
    metadata names the worker at fault."""

    def __init__(self, code: grpc.StatusCode, message: str, failed_worker_id: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.failed_worker_id = failed_worker_id


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(
        self,
        aengine: AsyncEngine,
        region: MemoryRegionHandle | None,
        *,
        role: str = "decode",
        prefill_deadline_s: float,
        worker_id: str = "",
        store: StoreLink | None = None,
    ) -> None:
        """``prefill_deadline_s``: a remote prefill's deadline, KV transfer included (the
        setting ``--prefill-deadline-s``; with ``LEASE_GRACE_S``, a failed prefill's KV lease).
        ``store``: the KV store a prompt prefilled here loads its prefix from."""
        self.aengine = aengine
        self.store = store
        self.region = region
        self.role = role
        self.prefill_deadline_s = prefill_deadline_s
        self.worker_id = worker_id
        self._channels = ChannelPool(cluster_auth.channel)  # to prefill workers
        self.receiver = KVReceiver(aengine, role=role, prefill_deadline_s=prefill_deadline_s)
        self.inflight = 0
        self.kv_bytes_received = 0
        metrics.PROMPT_TOKENS_CACHED.labels(role)  # exported at 0 from the start
        metrics.PROMPT_TOKENS_COMPUTED.labels(role)
        if region is not None:  # export the series at 0 before the first transfer
            metrics.TRANSFER_BYTES.labels(role, region.transport)

    async def close(self) -> None:
        await self._channels.close()

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
        resumed = list(request.resume_token_ids)

        remote = bool(request.prefill_address) and self.region is not None
        kv_bytes = 0
        try:
            if remote:
                stream, kv_bytes = await self._remote_prefill(request, ids, resumed, params)
            else:
                stream = self._local(rid, ids, params, resumed)
            first = True
            last = arrival
            async for out in stream:
                now = time.monotonic()
                if first:
                    metrics.TTFT.labels(self.role).observe(now - arrival)
                    first = False
                    if not remote:  # a remote prefill's hit is counted at its reservation
                        self._count_local_prefill(out, len(ids) + len(resumed))
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
            if e.failed_worker_id:
                context.set_trailing_metadata(((FAILED_WORKER_KEY, e.failed_worker_id),))
            await context.abort(e.code, e.message)
        except Exception as e:
            metrics.ERRORS.labels(self.role, status_for(e).name).inc()
            if status_for(e) is grpc.StatusCode.INTERNAL:
                log.exception("generate_failed")
            await abort_with(context, e)

    async def _local(
        self, rid: str, ids: list[int], params: SamplingParams, resumed: list[int]
    ) -> AsyncIterator[RequestOutput]:
        """Prefill here (the prefix the KV store holds loaded first), then decode."""
        link = self.store
        store = link.store if link is not None else None
        loading = link.loading() if link is not None else {"timeout_s": 1.0}
        async with loaded_prefix(self.aengine, store, [*ids, *resumed], **loading):
            async for out in self.aengine.generate(rid, ids, params, resumed):
                yield out

    async def _remote_prefill(
        self,
        request: worker_pb2.DecodeGenerateRequest,
        ids: list[int],
        resumed: list[int],
        params: SamplingParams,
    ) -> tuple[AsyncIterator[RequestOutput], int]:
        region = self.region
        assert region is not None

        async def ask(reservation: Reservation) -> Prefilled:
            preq = worker_pb2.PrefillRequest(
                request_id=request.request_id,
                prompt_token_ids=ids,
                resume_token_ids=resumed,
                sampling=request.sampling,
                deadline_ms=int(self.prefill_deadline_s * 1000),
                decode_worker_id=self.worker_id,
                placement_token=request.placement_token,
                attempt=request.attempt,
                kv_destination=worker_pb2.KVDestination(
                    region=handle_to_proto(region),
                    block_ids=reservation.block_ids,
                    num_present_tokens=reservation.num_present_tokens,
                ),
            )
            try:
                async with self._channels.lease(request.prefill_address) as channel:
                    stub = worker_pb2_grpc.PrefillWorkerStub(channel)
                    reply = await stub.Prefill(preq, timeout=self.prefill_deadline_s)
            except grpc.aio.AioRpcError as e:
                raise PrefillFailed(e, fenced=kv_fenced(e)) from e
            return Prefilled(
                reply.first_token_id,
                reply.first_token_logprob,
                reply.num_cached_tokens,  # usage: what the request did not compute
                reply.kv_transfer_bytes,
                top_logprobs_from_proto(reply.first_token_top_logprobs)
                if reply.HasField("first_token_top_logprobs")
                else None,
            )

        try:
            stream, done = await self.receiver.receive(
                request.request_id, ids, resumed, params, ask
            )
        except PrefillFailed as e:
            call = e.cause
            assert isinstance(call, grpc.aio.AioRpcError)
            raise UpstreamError(
                call.code(), f"prefill failed: {call.details()}", request.prefill_worker_id
            ) from e
        self.kv_bytes_received += done.kv_bytes
        metrics.TRANSFER_BYTES.labels(self.role, region.transport).inc(done.kv_bytes)
        return stream, done.kv_bytes

    def _count_local_prefill(self, first: RequestOutput, num_tokens: int) -> None:
        """Count a prompt (+ resumed tokens) prefilled here, by its first event."""
        metrics.PROMPT_TOKENS_CACHED.labels(self.role).inc(first.num_cached_tokens)
        metrics.PROMPT_TOKENS_COMPUTED.labels(self.role).inc(num_tokens - first.num_cached_tokens)

    def _event(self, out: RequestOutput, kv_bytes: int, prefill_id: str) -> worker_pb2.DecodeEvent:
        ev = worker_pb2.DecodeEvent(
            token_ids=list(out.new_token_ids),
            logprobs=list(out.new_logprobs),
            text=out.text_delta,
            produced_unix_ns=time.time_ns(),
            top_logprobs=[top_logprobs_to_proto(t) for t in out.new_top_logprobs],
        )
        if out.finished:
            ev.finish_reason = finish_to_proto(out.finish_reason)
            ev.usage.CopyFrom(usage(out))
            ev.kv_transfer_bytes = kv_bytes
            ev.prefill_worker_id = prefill_id
        return ev

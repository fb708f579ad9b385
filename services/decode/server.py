"""The decode worker's gRPC edge: continuous batching over a paged KV cache.

Request lifecycle (each stage a queue):
  received -> blocks reserved in the registered pool (admission by the batch target, the
     sequences its ITL target allows (``engine/step_budget.py``), and by free KV blocks; the
     blocks of the longest prefix this pool's prefix cache holds are reused: earlier
     requests' prompts and outputs, so a conversation's next turn finds the last one's)
  -> Prefill RPC to the chosen prefill worker, which writes the KV of the rest of the
     prompt straight into those blocks (``num_present_tokens``: what is already here)
  -> joined to the running batch with its first token -> tokens streamed until a stop
     condition -> blocks freed (finish, error or cancel; full ones stay cached).
When the request names no prefill worker (or on a colocated worker) the prompt is
prefilled here by the same engine. When the scheduler chose a local prefill for a short
uncached suffix (``local_prefill_max_tokens``), this worker checks it first: its own prefix
cache plus what its KV store's lookup finds now must leave at most that many tokens to
compute, else the prompt goes to the fallback prefill worker the placement names (a
reroute: counted, and the store's miss reaches the scheduler's index with the next
heartbeat), or is refused RESOURCE_EXHAUSTED when it names none. A long prompt is never
computed on the decode core because an index was stale.
A migrated request (``resume_token_ids``) has prompt + those tokens prefilled the same way
and continues after them.

The reservation, the Prefill call's outcome and the KV fence are ``KVReceiver``'s
(``services/decode/kv_receiver.py``). ``Generate`` is the edge: it converts the request
into a typed ``GenerateRequest`` and each output into a ``DecodeEvent``
(``services.common.convert``), and maps errors to statuses; the Prefill call it makes is
typed too (``services.common.worker_messages``) up to its stub.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import structlog

from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError, ResourceExhaustedError
from engine.llm_engine import Reservation
from engine.output_processor import RequestOutput
from kvstore.prefix import loaded_prefix, uncached_tokens
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.common import cluster_auth, metrics
from services.common.channels import ChannelPool
from services.common.convert import (
    FAILED_WORKER_KEY,
    abort_with,
    decode_event_to_proto,
    generate_request_from_proto,
    kv_fenced,
    prefill_reply_from_proto,
    prefill_request_to_proto,
    status_for,
)
from services.common.kv_store import StoreLink
from services.common.worker_messages import (
    GenerateRequest,
    KVDestination,
    PrefillPlacement,
    PrefillReply,
    PrefillRequest,
)
from services.decode.kv_receiver import KVReceiver, PrefillFailed
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
        metrics.LOCAL_PREFILL_REROUTES.labels(role)
        if region is not None:  # export the series at 0 before the first transfer
            metrics.TRANSFER_BYTES.labels(role, region.transport)

    async def close(self) -> None:
        await self._channels.close()

    async def Generate(
        self, request: worker_pb2.DecodeGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeEvent]:
        arrival = time.monotonic()
        structlog.contextvars.bind_contextvars(request_id=request.request_id)
        self.inflight += 1
        try:
            try:
                req = generate_request_from_proto(request)
            except InvalidRequestError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                return
            try:
                # Prefilled here when asked so, or on a colocated worker (no region to write).
                prefill = await self._prefill_worker(req) if self.region is not None else None
                prefill_id = prefill.worker_id if prefill is not None else ""
                if prefill is not None:
                    stream, kv_bytes = await self._remote_prefill(req, prefill)
                else:
                    stream, kv_bytes = self._local(req), 0
                async for out in self._metered(req, stream, arrival, local=prefill is None):
                    yield decode_event_to_proto(
                        out,
                        produced_unix_ns=time.time_ns(),
                        kv_transfer_bytes=kv_bytes,
                        prefill_worker_id=prefill_id,
                    )
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
        finally:
            self.inflight -= 1
            structlog.contextvars.unbind_contextvars("request_id")

    async def _metered(
        self,
        req: GenerateRequest,
        stream: AsyncIterator[RequestOutput],
        arrival: float,
        *,
        local: bool,
    ) -> AsyncIterator[RequestOutput]:
        """``stream``, its latencies and outcome observed; ``local``: prefilled here (a
        remote prefill's cache hit is counted at its reservation)."""
        first = True
        last = arrival
        async for out in stream:
            now = time.monotonic()
            if first:
                metrics.TTFT.labels(self.role).observe(now - arrival)
                first = False
                if local:
                    num_tokens = len(req.prompt_token_ids) + len(req.resume_token_ids)
                    self._count_local_prefill(out, num_tokens)
            else:
                metrics.ITL.labels(self.role).observe(now - last)
            last = now
            yield out
            if out.finished:
                metrics.E2E.labels(self.role).observe(now - arrival)
                metrics.REQUESTS.labels(self.role, out.finish_reason or "").inc()

    async def _prefill_worker(self, req: GenerateRequest) -> PrefillPlacement | None:
        """Who computes ``req``'s prompt: None (this worker) or a prefill worker. A local
        prefill the scheduler chose is checked here (module docstring)."""
        limit = req.local_prefill_max_tokens
        if limit <= 0:
            return req.prefill
        link = self.store
        store = link.store if link is not None else None
        timeout_s = link.args.kv_store_load_timeout_s if link is not None else 1.0
        ids = [*req.prompt_token_ids, *req.resume_token_ids]
        uncached = await uncached_tokens(self.aengine, store, ids, timeout_s=timeout_s)
        if uncached <= limit:
            return None
        metrics.LOCAL_PREFILL_REROUTES.labels(self.role).inc()
        log.info("local_prefill_rerouted", uncached_tokens=uncached, limit=limit,
                 prefill=req.prefill.worker_id if req.prefill else "")  # fmt: skip
        if req.prefill is None:
            raise ResourceExhaustedError(
                f"{uncached} prompt tokens are uncached here (limit {limit}) and no prefill "
                "worker was given"
            )
        return req.prefill

    async def _local(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Prefill here (the prefix the KV store holds loaded first), then decode."""
        link = self.store
        store = link.store if link is not None else None
        loading = link.loading() if link is not None else {"timeout_s": 1.0}
        ids, resumed = list(req.prompt_token_ids), list(req.resume_token_ids)
        async with loaded_prefix(self.aengine, store, [*ids, *resumed], **loading):
            async for out in self.aengine.generate(req.request_id, ids, req.sampling, resumed):
                yield out

    async def _remote_prefill(
        self, req: GenerateRequest, prefill: PrefillPlacement
    ) -> tuple[AsyncIterator[RequestOutput], int]:
        """Reserve blocks and have ``prefill`` fill them (``KVReceiver``): the request's
        stream and the KV bytes sent; ``UpstreamError`` when the Prefill call failed."""
        region = self.region
        assert region is not None

        async def ask(reservation: Reservation) -> PrefillReply:
            message = PrefillRequest(
                request_id=req.request_id,
                prompt_token_ids=req.prompt_token_ids,
                sampling=req.sampling,
                kv_destination=KVDestination(
                    region, reservation.block_ids, reservation.num_present_tokens
                ),
                deadline_s=self.prefill_deadline_s,
                decode_worker_id=self.worker_id,
                placement_token=prefill.placement_token,
                attempt=req.attempt,
                resume_token_ids=req.resume_token_ids,
            )
            try:
                async with self._channels.lease(prefill.address) as channel:
                    stub = worker_pb2_grpc.PrefillWorkerStub(channel)
                    reply = await stub.Prefill(
                        prefill_request_to_proto(message), timeout=self.prefill_deadline_s
                    )
            except grpc.aio.AioRpcError as e:
                raise PrefillFailed(e, fenced=kv_fenced(e)) from e
            return prefill_reply_from_proto(reply)

        try:
            stream, done = await self.receiver.receive(
                req.request_id, req.prompt_token_ids, req.resume_token_ids, req.sampling, ask
            )
        except PrefillFailed as e:
            call = e.cause
            assert isinstance(call, grpc.aio.AioRpcError)
            raise UpstreamError(
                call.code(), f"prefill failed: {call.details()}", prefill.worker_id
            ) from e
        self.kv_bytes_received += done.kv_transfer_bytes
        metrics.TRANSFER_BYTES.labels(self.role, region.transport).inc(done.kv_transfer_bytes)
        return stream, done.kv_transfer_bytes

    def _count_local_prefill(self, first: RequestOutput, num_tokens: int) -> None:
        """Count a prompt (+ resumed tokens) prefilled here, by its first event."""
        metrics.PROMPT_TOKENS_CACHED.labels(self.role).inc(first.num_cached_tokens)
        metrics.PROMPT_TOKENS_COMPUTED.labels(self.role).inc(num_tokens - first.num_cached_tokens)

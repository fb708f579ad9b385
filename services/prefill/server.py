"""The prefill worker's gRPC edge: compute a prompt, push its KV into the decode worker's
memory layer by layer, answer with the first token.

Request lifecycle (each stage a queue): received -> planned (local blocks, prefix-cache
hit) -> batched with prompts that arrived close together (AsyncEngine) -> forward pass,
each layer's KV handed to the transfer job as soon as it is written -> transfer confirmed
in the destination -> local blocks released (kept in the prefix cache) -> reply.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog

from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError
from engine.llm_engine import PrefillPlan
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.common import metrics
from services.common.convert import handle_from_proto, sampling_from_proto
from services.common.grpc_errors import abort_with
from transfer.base import Transport
from transfer.errors import TransferError
from transfer.handle import KVLayout

log = structlog.get_logger(__name__)

DEFAULT_DEADLINE_S = 30.0
ROLE = "prefill"


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, aengine: AsyncEngine, transports: dict[str, Transport]) -> None:
        self.aengine = aengine
        self.transports = transports
        eng = aengine.engine
        self.src = eng.kv.as_bytes()
        self.src_layout = KVLayout.from_spec(eng.kv_spec)
        self.inflight = 0
        for name in transports:  # export the series at 0 before the first transfer
            metrics.TRANSFER_BYTES.labels(ROLE, name)

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillReply:
        arrival = time.monotonic()
        rid = request.request_id
        structlog.contextvars.bind_contextvars(request_id=rid)
        self.inflight += 1
        try:
            return await self._prefill(request, context, arrival)
        finally:
            self.inflight -= 1
            structlog.contextvars.unbind_contextvars("request_id")

    async def _prefill(
        self,
        request: worker_pb2.PrefillRequest,
        context: grpc.aio.ServicerContext,
        arrival: float,
    ) -> worker_pb2.PrefillReply:
        rid = request.request_id
        try:
            if not rid:
                raise InvalidRequestError("request_id is required")
            params = sampling_from_proto(request.sampling)
            ids = list(request.prompt_token_ids)
            dest = request.kv_destination
            handle = handle_from_proto(dest.region)
            transport = self.transports.get(handle.transport)
            if transport is None:
                raise InvalidRequestError(
                    f"transport {handle.transport!r} is not served here "
                    f"(have {sorted(self.transports)})"
                )
            dst_ids = tuple(dest.block_ids)
            need = self.aengine.engine.blocks.blocks_needed(len(ids))
            if len(dst_ids) != need:
                raise InvalidRequestError(
                    f"kv_destination has {len(dst_ids)} blocks; {len(ids)} prompt tokens need "
                    f"{need}"
                )
        except (InvalidRequestError, TransferError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise AssertionError("unreachable") from e

        budget = request.deadline_ms / 1000 if request.deadline_ms else DEFAULT_DEADLINE_S
        deadline = arrival + budget
        try:
            job = transport.connect(handle).begin(rid, deadline=deadline)
        except TransferError as e:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"cannot reach the KV destination: {e}"
            )
            raise AssertionError("unreachable") from e

        def on_layer(plan: PrefillPlan, layer: int) -> None:
            try:
                job.write_blocks(layer, self.src, self.src_layout, plan.block_ids, dst_ids)
            except TransferError:
                pass  # the job has failed; finish() reports it for this request only

        t0 = time.monotonic()
        try:
            out = await asyncio.wait_for(
                self.aengine.prefill(rid, ids, params, on_layer), deadline - time.monotonic()
            )
        except BaseException as e:
            job.abort()
            if isinstance(e, asyncio.CancelledError):
                raise
            metrics.ERRORS.labels(ROLE, type(e).__name__).inc()
            await abort_with(context, e)
            raise AssertionError("unreachable") from e
        computed = time.monotonic()
        try:
            result = await asyncio.to_thread(job.finish)
        except TransferError as e:
            metrics.ERRORS.labels(ROLE, type(e).__name__).inc()
            await abort_with(context, e)
            raise AssertionError("unreachable") from e
        finally:
            # The source blocks must not change until the transfer is confirmed.
            await self.aengine.release(rid)
        done = time.monotonic()
        metrics.TRANSFER_BYTES.labels(ROLE, handle.transport).inc(result.bytes)
        metrics.TRANSFER_SECONDS.labels(ROLE, handle.transport).observe(result.seconds)
        log.info(
            "prefilled",
            prompt_tokens=len(ids),
            cached_tokens=out.num_cached_tokens,
            kv_bytes=result.bytes,
            compute_s=round(computed - t0, 4),
            transfer_tail_s=round(done - computed, 4),
        )
        return worker_pb2.PrefillReply(
            request_id=rid,
            first_token_id=out.token_id,
            first_token_logprob=out.logprob,
            num_cached_tokens=out.num_cached_tokens,
            num_computed_tokens=len(ids) - out.num_cached_tokens,
            kv_transfer_bytes=result.bytes,
            queue_seconds=t0 - arrival,
            compute_seconds=computed - t0,
            transfer_seconds=result.seconds,
            transfer_tail_seconds=done - computed,
        )

"""The prefill worker's gRPC edge: compute a prompt, push its KV into the decode worker's
memory layer by layer, answer with the first token.

Request lifecycle (each stage a queue): received -> planned (local blocks, prefix-cache
hit) -> transfer begun -> batched with prompts that arrived close together (AsyncEngine)
-> forward pass, each layer handed to the transfer job as soon as its KV is written ->
transfer confirmed in the destination -> reply. Whatever happens, the local blocks are
released (kept in the prefix cache) only once the transfer's outcome is in.

Partial transfer: the destination's leading ``num_present_tokens`` (the decode worker's own
cached prefix) are not written, only the blocks after them. The prompt is still computed
from this worker's own prefix cache or afresh: it never reads KV from the destination, so
a prefix only the decode worker holds is computed here again, just not sent.

KV fencing, the writer's half: an error reply carries the trailing metadata
``pdserve-kv-fenced: 1`` only when no byte of the request can land in the destination any
more (the writer never began, or its abort came back with the job quiet: see
``TransferJob.quiet``), so the reader may reuse its blocks at once; without it the reader
waits out the KV lease (the deadline plus its grace).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import NoReturn

import grpc
import structlog

from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.common import metrics
from services.common.background import Background
from services.common.convert import handle_from_proto, sampling_from_proto
from services.common.grpc_errors import KV_FENCED, abort_with
from services.common.placement_token import PlacementTokenError, verify_write
from transfer.base import KVSource, TransferJob, TransferResult, Transport
from transfer.errors import IncompatibleLayoutError, TransferError
from transfer.handle import KVLayout
from transfer.plan import first_repeat

log = structlog.get_logger(__name__)

DEFAULT_DEADLINE_S = 30.0
# How long past its deadline a transfer's outcome may come (the writer fails the job at the
# deadline); later, the writer is taken for stuck.
OUTCOME_GRACE_S = 5.0
ROLE = "prefill"


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(
        self,
        aengine: AsyncEngine,
        transports: dict[str, Transport],
        *,
        placement_key: bytes | None = None,
    ) -> None:
        """``placement_key``: with it, a destination is written only under a valid placement
        token (``services.common.placement_token``); None: any destination (open cluster)."""
        self.aengine = aengine
        self.placement_key = placement_key
        self.transports = transports
        eng = aengine.engine
        # A GPU engine's pool is staged into a host pool of the same layout (kv_host) for
        # the transports that send from host memory; cuda_ipc copies from the pool itself.
        layout = KVLayout.from_spec(eng.kv_spec)
        self.sources = {
            on_device: KVSource((eng.kv if on_device else eng.kv_host).as_bytes(), layout)
            for on_device in {t.source_on_device for t in transports.values()}
        }
        self.inflight = 0
        self._releases = Background()
        # Engine keys are per call: a request placed again (a migration, a retry) may reach
        # this worker while its earlier attempt's blocks are still held for a transfer.
        self._calls = itertools.count()
        metrics.QUEUE_TIME.labels(ROLE)  # exported from the start, as the series below
        metrics.PROMPT_TOKENS_CACHED.labels(ROLE)
        metrics.PROMPT_TOKENS_COMPUTED.labels(ROLE)
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
            resumed = list(request.resume_token_ids)
            dest = request.kv_destination
            handle = handle_from_proto(dest.region)
            transport = self.transports.get(handle.transport)
            if transport is None:
                raise InvalidRequestError(
                    f"transport {handle.transport!r} is not served here "
                    f"(have {sorted(self.transports)})"
                )
            dst_ids = tuple(dest.block_ids)
            outside = [b for b in dst_ids if b >= handle.layout.num_blocks]
            if outside:
                raise InvalidRequestError(
                    f"kv_destination block id {outside[0]} outside the region's "
                    f"{handle.layout.num_blocks} blocks"
                )
            twice = first_repeat(dst_ids)
            if twice is not None:
                raise InvalidRequestError(f"kv_destination names block {twice} twice")
            need = self.aengine.engine.blocks.blocks_needed(len(ids) + len(resumed))
            if len(dst_ids) != need:
                raise InvalidRequestError(
                    f"kv_destination has {len(dst_ids)} blocks; {len(ids)} prompt tokens "
                    f"+ {len(resumed)} resumed need {need}"
                )
            skip = _present_blocks(
                dest.num_present_tokens, handle.layout.block_size, len(ids) + len(resumed)
            )
        except (InvalidRequestError, TransferError) as e:
            await _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))

        if self.placement_key is not None:
            try:
                verify_write(
                    self.placement_key, request.placement_token, request_id=rid,
                    decode_worker_id=request.decode_worker_id, transport=handle.transport,
                    address=handle.address, region_id=handle.region_id, now_unix_s=time.time(),
                )  # fmt: skip
            except PlacementTokenError as e:
                log.warning("kv_destination_refused", reason=str(e))
                denied = grpc.StatusCode.PERMISSION_DENIED
                await context.abort(denied, f"KV destination refused: {e}")
                raise AssertionError("unreachable") from e
        budget = request.deadline_ms / 1000 if request.deadline_ms else DEFAULT_DEADLINE_S
        deadline = arrival + budget
        try:
            # Off the event loop: opening a path may dial the destination (a tcp connect),
            # and one unreachable decode worker must not stall every other call here.
            writer = await asyncio.to_thread(
                transport.connect, handle, self.sources[transport.source_on_device]
            )
        except IncompatibleLayoutError as e:
            await _refuse(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except TransferError as e:
            await _refuse(
                context, grpc.StatusCode.UNAVAILABLE, f"cannot reach the KV destination: {e}"
            )

        key = f"{rid}#{next(self._calls)}"
        try:
            plan = await self.aengine.plan_prefill(key, ids, params, resumed)
        except Exception as e:
            await self._fail(context, e, fenced=True)
        job: TransferJob | None = None
        try:
            # The destination already holds its leading blocks: only the rest is written.
            sent = plan.block_ids[skip:]
            job = writer.begin(rid, sent, dst_ids[skip:], deadline=deadline)
            t0 = time.monotonic()
            metrics.QUEUE_TIME.labels(ROLE).observe(t0 - arrival)
            out = await asyncio.wait_for(
                self.aengine.run_prefill(
                    plan, _layer_writer(self.aengine.engine, job, sent, transport)
                ),
                deadline - t0,
            )
            computed = time.monotonic()
            metrics.PROMPT_TOKENS_CACHED.labels(ROLE).inc(out.num_cached_tokens)
            metrics.PROMPT_TOKENS_COMPUTED.labels(ROLE).inc(plan.num_tokens - out.num_cached_tokens)
            job.finish()
            result = await _outcome(job)
        except asyncio.CancelledError:
            if job is not None:
                job.abort("cancelled: the caller went away")
            raise
        except Exception as e:
            fenced = True
            if job is not None:
                job.abort(f"failed: {type(e).__name__}")
                fenced = await _stopped(job) and job.quiet
            await self._fail(context, e, fenced=fenced)
        finally:
            # The source blocks are read by the transfer until its outcome is in; the
            # release waits for that, and the reply need not wait for the release (a
            # command to the engine thread, which may be computing another prompt).
            self._release_later(key, job)
        done = time.monotonic()
        metrics.TRANSFER_BYTES.labels(ROLE, handle.transport).inc(result.bytes)
        metrics.TRANSFER_SECONDS.labels(ROLE, handle.transport).observe(result.seconds)
        log.info(
            "prefilled",
            prompt_tokens=len(ids),
            cached_tokens=out.num_cached_tokens,
            present_tokens=skip * handle.layout.block_size,
            kv_bytes=result.bytes,
            compute_s=round(computed - t0, 4),
            transfer_tail_s=round(done - computed, 4),
        )
        return worker_pb2.PrefillReply(
            request_id=rid,
            first_token_id=out.token_id,
            first_token_logprob=out.logprob,
            num_cached_tokens=out.num_cached_tokens,
            num_computed_tokens=plan.num_tokens - out.num_cached_tokens,
            kv_transfer_bytes=result.bytes,
            queue_seconds=t0 - arrival,
            compute_seconds=computed - t0,
            transfer_seconds=result.seconds,
            transfer_tail_seconds=done - computed,
        )

    async def _fail(
        self, context: grpc.aio.ServicerContext, e: BaseException, *, fenced: bool
    ) -> NoReturn:
        metrics.ERRORS.labels(ROLE, type(e).__name__).inc()
        if fenced:
            context.set_trailing_metadata((KV_FENCED,))
        await abort_with(context, e)
        raise AssertionError("unreachable") from e

    def _release_later(self, rid: str, job: TransferJob | None) -> None:
        self._releases.spawn(self._release_when_stopped(rid, job))

    async def _release_when_stopped(self, rid: str, job: TransferJob | None) -> None:
        """Release the request's local blocks once no transfer reads them any more."""
        if job is not None and not await _stopped(job):
            # The writer never reported back: its blocks are leaked, not reused under a
            # copy that may still run.
            log.error("transfer_outcome_lost", request_id=rid)
            return
        await self.aengine.release(rid)


def _layer_writer(
    engine: LLMEngine, job: TransferJob, block_ids: tuple[int, ...], transport: Transport
) -> Callable[[int], None]:
    """The engine-thread hook that hands each computed layer to the transfer: staged to the
    host pool first when the engine's pool is elsewhere (a GPU's), unless the transport
    reads that pool itself (then only ordered after the layer's KV store)."""

    def on_layer_kv(layer: int) -> None:
        if transport.source_on_device:
            job.write_layer(layer, engine.layer_written(layer))
        else:
            job.write_layer(layer, engine.stage_layer(layer, block_ids))

    return on_layer_kv


def _present_blocks(present: int, block_size: int, num_tokens: int) -> int:
    """How many leading destination blocks already hold their KV (a KVDestination's
    ``num_present_tokens``, of ``num_tokens`` prompt + resumed tokens): they are not written.
    Raises InvalidRequestError unless it is a block multiple below ``num_tokens``."""
    if present % block_size or present >= num_tokens:
        raise InvalidRequestError(
            f"kv_destination.num_present_tokens is {present}: it must be a multiple of the "
            f"region's block size ({block_size}) and less than the {num_tokens} prompt + "
            f"resumed tokens (the last token's block is always written)"
        )
    return present // block_size


async def _refuse(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str
) -> NoReturn:
    """Refuse a call before any writer began: nothing was written."""
    context.set_trailing_metadata((KV_FENCED,))
    await context.abort(code, message)
    raise AssertionError("unreachable")


async def _stopped(job: TransferJob) -> bool:
    """Whether a job's writer reported its outcome (success or failure) by the deadline plus
    grace: it no longer touches the source or the destination."""
    try:
        await _outcome(job)
    except TransferError:
        return True
    except TimeoutError:
        return False
    return True


async def _outcome(job: TransferJob) -> TransferResult:
    """A transfer's outcome; ``TimeoutError`` if the writer did not report by the job's
    deadline plus ``OUTCOME_GRACE_S``."""
    left = max(0.0, job.deadline - time.monotonic()) + OUTCOME_GRACE_S
    return await asyncio.wait_for(asyncio.wrap_future(job.outcome), left)

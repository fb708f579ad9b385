"""The prefill worker's gRPC edge: compute a prompt, push its KV into the decode worker's
memory layer by layer, answer with the first token.

Request lifecycle (each stage a queue): received -> checked (destination, placement token)
-> prefix loaded from the KV store (``kvstore.prefix``: blocks this worker lacks and the
store holds) -> planned (local blocks, prefix-cache hit) -> transfer begun -> batched with
prompts that arrived close together (AsyncEngine) -> forward pass (a prompt longer than
``--prefill-token-budget``: one chunk per pass), each layer handed to the transfer job as
soon as its KV is written -> transfer confirmed in the destination -> reply. A call the
decode worker cancels (its client left) stops its prompt before the next chunk, aborts the
transfer and releases the blocks once the writer stopped.
The transfer and the local blocks are ``KVSender``'s (``services/prefill/kv_sender.py``);
``Prefill`` is the edge: it converts the request into a typed ``PrefillRequest`` and the
typed reply back (``services.common.convert``), and maps outcomes to statuses.

Partial transfer: the destination's leading ``num_present_tokens`` (the decode worker's own
cached prefix) are not written, only the blocks after them. The prompt is still computed
from this worker's own prefix cache or afresh: it never reads KV from the destination, so
a prefix only the decode worker holds is computed here again, just not sent.

KV fencing, the writer's half: an error reply carries the trailing metadata
``pdserve-kv-fenced: 1`` only when no byte of the request can land in the destination any
more (``SendFailed.fenced``), so the reader may reuse its blocks at once; without it the
reader waits out the KV lease (the deadline plus its grace).
"""

from __future__ import annotations

import time
from typing import NoReturn

import grpc
import structlog

from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.common import metrics
from services.common.convert import (
    KV_FENCED,
    abort_with,
    prefill_reply_to_proto,
    prefill_request_from_proto,
)
from services.common.kv_store import StoreLink
from services.common.placement_token import PlacementTokenError, VerifyKeys, verify_write
from services.common.worker_messages import KVDestination, PrefillReply, PrefillRequest
from services.prefill.kv_sender import ROLE, KVSender, SendFailed
from transfer.base import Transport
from transfer.block_runs import first_repeat
from transfer.errors import TransferError

log = structlog.get_logger(__name__)

DEFAULT_DEADLINE_S = 30.0


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(
        self,
        aengine: AsyncEngine,
        transports: dict[str, Transport],
        *,
        worker_id: str,
        verify_keys: VerifyKeys | None,
        store: StoreLink | None = None,
    ) -> None:
        """A destination is written only under a placement token signed by one of
        ``verify_keys`` (the scheduler's, filled as this worker registers) for this worker,
        ``worker_id`` (``services.common.placement_token``); None: any destination (an
        ``--insecure-cluster``, where nothing internal is checked).
        ``store``: the KV store a prompt's prefix is loaded from before it is computed."""
        self.aengine = aengine
        self.worker_id = worker_id
        self.verify_keys = verify_keys
        self.sender = KVSender(aengine, transports, store)
        self.inflight = 0
        metrics.QUEUE_TIME.labels(ROLE)  # exported from the start, as the series below
        metrics.PROMPT_TOKENS_CACHED.labels(ROLE)
        metrics.PROMPT_TOKENS_COMPUTED.labels(ROLE)
        for name in transports:  # export the series at 0 before the first transfer
            metrics.TRANSFER_BYTES.labels(ROLE, name)
            metrics.KV_OVERLAP.labels(ROLE, name)

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillReply:
        arrival = time.monotonic()
        structlog.contextvars.bind_contextvars(request_id=request.request_id)
        self.inflight += 1
        try:
            try:
                req = prefill_request_from_proto(request)
                self._check(req)
            except (InvalidRequestError, TransferError) as e:
                await _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            try:
                reply = await self._prefill(req, arrival)
            except PlacementTokenError as e:
                log.warning("kv_destination_refused", reason=str(e))
                denied = grpc.StatusCode.PERMISSION_DENIED
                await context.abort(denied, f"KV destination refused: {e}")
                raise AssertionError("unreachable") from e
            except SendFailed as e:
                await self._fail(context, e.cause, fenced=e.fenced)
            return prefill_reply_to_proto(reply)
        finally:
            self.inflight -= 1
            structlog.contextvars.unbind_contextvars("request_id")

    def _check(self, req: PrefillRequest) -> None:
        """``InvalidRequestError`` naming the first thing wrong with the request's
        destination (``_check_destination``) or its transport (not served here)."""
        num_tokens = len(req.prompt_token_ids) + len(req.resume_token_ids)
        need = self.aengine.engine.blocks.blocks_needed(num_tokens)
        _check_destination(req.kv_destination, need, num_tokens)
        self.sender.transport(req.kv_destination.region.transport)

    async def _prefill(self, req: PrefillRequest, arrival: float) -> PrefillReply:
        """Compute the prompt and deliver its KV: ``PlacementTokenError`` when the placement
        token does not allow writing into the destination (nothing written), ``SendFailed``
        when the prompt or its transfer failed."""
        dest = req.kv_destination
        if self.verify_keys is not None:
            verify_write(
                self.verify_keys.keys(), req.placement_token, request_id=req.request_id,
                attempt=req.attempt, decode_worker_id=req.decode_worker_id,
                prefill_worker_id=self.worker_id, transport=dest.region.transport,
                address=dest.region.address, region_id=dest.region.region_id,
                now_unix_s=time.time(),
            )  # fmt: skip
        budget = req.deadline_s or DEFAULT_DEADLINE_S
        sent = await self.sender.send(
            req.request_id,
            req.prompt_token_ids,
            req.resume_token_ids,
            req.sampling,
            dest,
            arrival=arrival,
            deadline=arrival + budget,
        )
        out, result = sent.output, sent.transfer
        transport = dest.region.transport
        metrics.PROMPT_TOKENS_CACHED.labels(ROLE).inc(out.num_cached_tokens)
        metrics.TRANSFER_BYTES.labels(ROLE, transport).inc(result.bytes)
        metrics.TRANSFER_SECONDS.labels(ROLE, transport).observe(result.seconds)
        overlap = result.present_at_last_layer / result.bytes if result.bytes else 1.0
        metrics.KV_OVERLAP.labels(ROLE, transport).observe(overlap)
        log.info(
            "prefilled",
            prompt_tokens=len(req.prompt_token_ids),
            cached_tokens=out.num_cached_tokens,
            loaded_tokens=sent.loaded.tokens,
            load_s=round(sent.loaded.seconds, 4),
            present_tokens=dest.num_present_tokens,
            kv_bytes=result.bytes,
            kv_present_at_compute_end=round(overlap, 3),
            compute_s=round(sent.compute_seconds, 4),
            transfer_tail_s=round(sent.tail_seconds, 4),
        )
        return PrefillReply(
            request_id=req.request_id,
            first_token_id=out.token_id,
            first_token_logprob=out.logprob,
            first_token_top_logprobs=out.top_logprobs,
            num_cached_tokens=out.num_cached_tokens,
            num_computed_tokens=sent.num_tokens - out.num_cached_tokens,
            kv_transfer_bytes=result.bytes,
            queue_seconds=sent.queue_seconds,
            compute_seconds=sent.compute_seconds,
            transfer_seconds=result.seconds,
            transfer_tail_seconds=sent.tail_seconds,
        )

    async def _fail(
        self, context: grpc.aio.ServicerContext, e: BaseException, *, fenced: bool
    ) -> NoReturn:
        metrics.ERRORS.labels(ROLE, type(e).__name__).inc()
        if fenced:
            context.set_trailing_metadata((KV_FENCED,))
        await abort_with(context, e)
        raise AssertionError("unreachable") from e


def _check_destination(dest: KVDestination, need: int, num_tokens: int) -> None:
    """A request's ``kv_destination`` checked against the ``need`` blocks its ``num_tokens``
    prompt + resumed tokens take; ``InvalidRequestError`` naming the first thing wrong."""
    num_blocks = dest.region.layout.num_blocks
    outside = [b for b in dest.block_ids if b >= num_blocks]
    if outside:
        raise InvalidRequestError(
            f"kv_destination block id {outside[0]} outside the region's {num_blocks} blocks"
        )
    twice = first_repeat(dest.block_ids)
    if twice is not None:
        raise InvalidRequestError(f"kv_destination names block {twice} twice")
    if len(dest.block_ids) != need:
        raise InvalidRequestError(
            f"kv_destination has {len(dest.block_ids)} blocks; {num_tokens} prompt + resumed "
            f"tokens need {need}"
        )
    present = dest.num_present_tokens
    block_size = dest.region.layout.block_size
    if present % block_size or present >= num_tokens:
        raise InvalidRequestError(
            f"kv_destination.num_present_tokens is {present}: it must be a multiple of the "
            f"region's block size ({block_size}) and less than the {num_tokens} prompt + "
            f"resumed tokens (the last token's block is always written)"
        )


async def _refuse(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str
) -> NoReturn:
    """Refuse a call before any writer began: nothing was written."""
    context.set_trailing_metadata((KV_FENCED,))
    await context.abort(code, message)
    raise AssertionError("unreachable")

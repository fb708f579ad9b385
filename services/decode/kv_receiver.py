"""The decode worker's half of a KV transfer, owned in one place: reserve -> ask -> join, or
fence -> lease -> release.

``KVReceiver.receive`` reserves the blocks a prompt (+ a migrated request's resumed tokens)
needs in the registered pool, the longest prefix this pool's cache holds reused, and has
``ask`` (the Prefill call to a prefill worker) fill the rest. On success the request joins
the running batch with its first token.

A request cancelled meanwhile (its client left) cancels the call with it: the prefill
worker stops the prompt before its next chunk and aborts its transfer.

The fence, the reader's half: reserved blocks whose prefill did not deliver are set aside
(``AsyncEngine.fence``: the request id is free for another attempt) and reused only once
their writer is known to have stopped: a failure marked fenced (no byte of it can land any
more), or else the KV lease, which ends ``LEASE_GRACE_S`` after the prefill deadline counted
from the ask (a cancelled call's writer too: no reply can say when it stopped).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import structlog

from engine.async_engine import AsyncEngine
from engine.llm_engine import Reservation
from engine.output_processor import RequestOutput
from engine.sampling_params import SamplingParams
from services.common import metrics
from services.common.background import Background
from services.common.worker_messages import PrefillReply

log = structlog.get_logger(__name__)

# The writer stops at the deadline it counts from its receipt of the request, and a failed
# transfer drains for at most transfer.writer.DRAIN_TIMEOUT_S, after which its bytes are
# either confirmed dropped or the connection that carried them is closed. The lease ends
# this long after the deadline counted from the send: the delay to receipt, and the bytes
# of a closed connection still being written, land well within it.
LEASE_GRACE_S = 2.0


class PrefillFailed(Exception):
    """A Prefill call that did not deliver. ``fenced``: its writer says no byte of it can
    land any more; ``cause``: the call's own error (the edge maps it to a status)."""

    def __init__(self, cause: BaseException, *, fenced: bool) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.fenced = fenced


Ask = Callable[[Reservation], Awaitable[PrefillReply]]


class KVReceiver:
    """Receives prompts' KV into this worker's registered pool."""

    def __init__(self, aengine: AsyncEngine, *, role: str, prefill_deadline_s: float) -> None:
        self.aengine = aengine
        self.role = role
        self.prefill_deadline_s = prefill_deadline_s
        self._fences = Background()
        self._tags = itertools.count()
        for how in ("confirmed", "lease"):  # exported at 0 from the start
            metrics.KV_FENCES.labels(role, how)

    async def receive(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        resumed: Sequence[int],
        params: SamplingParams,
        ask: Ask,
    ) -> tuple[AsyncIterator[RequestOutput], PrefillReply]:
        """Reserve, have ``ask`` fill the blocks, join the batch: the request's stream and
        the prefill's answer. ``PrefillFailed`` (and any other error) leaves the blocks
        fenced or free, never given out under a writer that may still write."""
        reservation = await self.aengine.reserve(request_id, prompt_ids, params, resumed)
        metrics.PROMPT_TOKENS_CACHED.labels(self.role).inc(reservation.num_present_tokens)
        lease_end = time.monotonic() + self.prefill_deadline_s + LEASE_GRACE_S
        call = asyncio.ensure_future(ask(reservation))
        try:
            done = await call  # a departed client cancels it: nobody would read its KV
        except PrefillFailed as e:
            if e.fenced:
                await self.aengine.release(request_id)
                metrics.KV_FENCES.labels(self.role, "confirmed").inc()
            else:
                self._fence(request_id, call, lease_end)
            raise
        except BaseException:  # cancelled (the client left), or a bug
            call.cancel()
            self._fence(request_id, call, lease_end)
            raise
        stream = self.aengine.join_prefilled(
            request_id,
            done.first_token_id,
            done.first_token_logprob,
            num_cached_tokens=done.num_cached_tokens,  # usage: what the request did not compute
            first_top_logprobs=done.first_token_top_logprobs,
        )
        return stream, done

    def _fence(self, request_id: str, call: asyncio.Future[Any], lease_end: float) -> None:
        """Set the reservation aside now (the id is free for another attempt) and release
        its blocks once the call says its writer stopped, or at ``lease_end``."""
        fenced = self.aengine.fence(request_id, f"fenced-{next(self._tags)}")

        async def release() -> None:
            key = await asyncio.wrap_future(fenced)
            how = "lease"
            try:
                await asyncio.wait_for(asyncio.shield(call), max(0.0, lease_end - time.monotonic()))
                how = "confirmed"  # it delivered after all, into blocks nobody reads
            except PrefillFailed as e:
                if e.fenced:
                    how = "confirmed"
            except (Exception, asyncio.CancelledError):  # timed out, or failed unfenced
                pass
            if how == "lease":
                await asyncio.sleep(max(0.0, lease_end - time.monotonic()))
            await self.aengine.release(key)
            metrics.KV_FENCES.labels(self.role, how).inc()
            log.info("kv_fence_released", request_id=request_id, how=how)

        self._fences.spawn(release())

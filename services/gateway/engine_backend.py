"""``EngineBackend``: the ``Backend`` protocol over a colocated engine in this process.

Used by the single-process gateway (``--backend local``) and by the gateway's tests. The
engine runs on its own thread (``AsyncEngine``); this class only adapts its events to
``GenerateChunk``. How many requests run at once is the gateway's admission's business
(``admission``), the same for every backend: each request tells it the engine's batch
target (``on_target_batch``), as a placement tells the fleet's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import structlog

from engine.async_engine import AsyncEngine
from services.gateway.backend import BackendUnavailableError, GenerateChunk, GenerateInput

log = structlog.get_logger(__name__)

_READY_TIMEOUT_S = 2.0


class EngineBackend:
    """Serve requests with an ``AsyncEngine`` (colocated prefill and decode).

    Call ``start`` from the event loop before use and ``stop`` when done; ``stop`` stops
    the engine.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        # Called with the engine's batch target at each request (admission follows it).
        self.on_target_batch: Callable[[int], None] = lambda n: None
        self._active = 0
        self._started = False
        self._stopping = False

    @property
    def num_active(self) -> int:
        """Requests currently streaming through this backend."""
        return self._active

    def start(self) -> None:
        self.engine.start()
        self._started = True

    async def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self._started:
            await self.engine.stop(timeout)

    async def ready(self) -> bool:
        """True when the engine thread answers a no-op command within 2 s."""
        if not self._started or self._stopping:
            return False
        try:
            return bool(await asyncio.wait_for(self.engine.call(lambda: True), _READY_TIMEOUT_S))
        except TimeoutError:
            return False

    async def generate(self, req: GenerateInput) -> AsyncIterator[GenerateChunk]:
        if not self._started or self._stopping:
            raise BackendUnavailableError("the engine is not running")
        self.on_target_batch(self.engine.stats.target_batch)
        self._active += 1
        stream = self.engine.generate(req.request_id, list(req.prompt_token_ids), req.params)
        try:
            async with aclosing(stream):
                # Closing the stream (also mid-submission) aborts the request in the engine.
                async for ev in stream:
                    yield GenerateChunk(
                        text_delta=ev.text_delta,
                        token_ids=ev.new_token_ids,
                        logprobs=ev.new_logprobs if req.params.logprobs else (),
                        finish_reason=ev.finish_reason,
                        prompt_tokens=ev.num_prompt_tokens,
                        completion_tokens=ev.num_output_tokens,
                        cached_tokens=ev.num_cached_tokens,
                        produced_unix_ns=time.time_ns(),
                        top_logprobs=ev.new_top_logprobs,
                    )
        finally:
            self._active -= 1

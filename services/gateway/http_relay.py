"""One request's merged choices to its HTTP client: collected whole, or relayed as SSE.

Errors before the first chunk raise ``ApiError`` (the handler answers with a status);
later ones cannot change the status any more: a whole response turns them into a 500 (it
has sent nothing yet), a stream reports them in-band (``out.stream_error``) and still ends
with ``[DONE]``. A stream is started (200 and the SSE headers) only once its first chunk is
in hand, and a write that waits longer than the write timeout (the client stopped reading)
cuts the connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from engine.errors import EngineError
from services.gateway import openai_responses as out
from services.gateway.backend import GenerateChunk
from services.gateway.openai_api import ApiError, from_engine_error
from services.gateway.openai_endpoints import Results, Shape

log = structlog.get_logger(__name__)

Choice = tuple[int, GenerateChunk]  # a chunk of one of a request's n choices


class _StreamFailed(Exception):
    """The backend failed after the response started; the stream reports it in-band."""


class _SlowReader(Exception):
    """A stream write waited past the write timeout: the client stopped reading."""


async def _chunks(stream: AsyncIterator[Choice], prompt_param: str) -> AsyncIterator[Choice]:
    """``stream``'s chunks until every choice has finished. Errors before the first chunk
    raise ``ApiError``; later ones raise ``_StreamFailed`` (the response has started)."""
    started = False
    try:
        async for item in stream:
            started = True
            yield item
    except EngineError as exc:
        if not started:
            raise from_engine_error(exc, prompt_param) from None
        raise _StreamFailed(str(exc)) from exc
    except Exception as exc:
        if not started:
            raise  # a server fault before the response started: the middleware's 500
        log.exception("backend_stream_failed")
        raise _StreamFailed(f"internal error ({type(exc).__name__})") from exc


async def collect(stream: AsyncIterator[Choice], n: int, prompt_param: str) -> Results:
    """Every choice's whole generation; a failure is a 500 (nothing was sent yet)."""
    results = Results.of(n)
    try:
        async for i, c in _chunks(stream, prompt_param):
            results.add(i, c)
    except _StreamFailed as exc:
        raise ApiError(500, f"Generation failed: {exc}", "server_error") from exc
    if any(c.finish_reason == "error" for c in results.choices):
        raise ApiError(500, "Generation failed in the backend.", "server_error")
    return results


async def _sse_response(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies must not buffer a token stream
        }
    )
    await resp.prepare(request)
    return resp


class SseRelay:
    """Streams one request's generations as SSE, started only once the first chunk is in
    hand. ``on_slow_reader`` runs when a client that stopped reading is cut."""

    def __init__(
        self,
        request: web.Request,
        stream: AsyncIterator[Choice],
        prompt_param: str,
        write_timeout_s: float,
        on_slow_reader: Callable[[], None],
    ) -> None:
        self.request = request
        self.write_timeout_s = write_timeout_s
        self.on_slow_reader = on_slow_reader
        self.chunks = aiter(_chunks(stream, prompt_param))
        self.first: Choice | None = None
        self.resp: web.StreamResponse | None = None

    async def start(self) -> None:
        """Wait for the first chunk (errors raise ``ApiError``), then send the headers."""
        self.first = await anext(self.chunks)
        self.resp = await _sse_response(self.request)

    async def run(self, shape: Shape[Any], started: Callable[[], None]) -> web.StreamResponse:
        """Send the shape's intro, each chunk's frames, the usage frame (when asked for)
        and ``[DONE]``; ``started`` runs once the first chunk's frames are written (a log
        line, which should not delay the first token)."""
        last: dict[int, GenerateChunk] = {}
        try:
            try:
                for frame in shape.intro():
                    await self._send(frame)
                async for i, c in self._all():
                    first = not last
                    last[i] = c
                    for frame in shape.frames(i, c):
                        await self._send(frame)
                    if first:
                        started()
                usage = shape.usage_frame(last) if last else None
                if usage is not None:
                    await self._send(usage)
            except _StreamFailed as exc:
                log.warning("stream_failed", error=str(exc))
                await self._send(out.stream_error(str(exc)))
            await self._send(out.SSE_DONE)
            return await self._finish()
        except ConnectionResetError:
            # The client left between two writes (the handler was not cancelled first).
            log.info("client_disconnected")
            assert self.resp is not None
            return self.resp
        except _SlowReader:
            log.warning("slow_reader_cut", write_timeout_s=self.write_timeout_s)
            self.on_slow_reader()
            return self._cut()

    async def _all(self) -> AsyncIterator[Choice]:
        """Every chunk, the first included, up to the last."""
        assert self.first is not None
        yield self.first
        async for c in self.chunks:
            yield c

    async def _send(self, obj: dict[str, Any] | bytes) -> None:
        assert self.resp is not None
        await self._timed(self.resp.write(obj if isinstance(obj, bytes) else out.sse(obj)))

    async def _finish(self) -> web.StreamResponse:
        assert self.resp is not None
        await self._timed(self.resp.write_eof())
        return self.resp

    async def _timed(self, write: Awaitable[None]) -> None:
        # A write waits only when the socket's buffers are full: the client is not reading.
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await write
        except TimeoutError:
            raise _SlowReader from None

    def _cut(self) -> web.StreamResponse:
        """Drop the connection of a client that stopped reading (its unsent bytes too)."""
        assert self.resp is not None
        if self.request.transport is not None:
            self.request.transport.abort()
        return self.resp

"""``n`` choices for one OpenAI request: n generations of one prompt, streamed as one.

Choice ``i`` is an ordinary request (``<request id>-<i>``) with the request's parameters,
its seed (when set) ``seed + i``: so every choice is reproducible on its own, migrates like
any seeded stream, and choice 0 of a seeded request equals the same request with ``n`` = 1.
(vLLM seeds its choices the same way.)

The prompt is computed once: choice 0 starts alone, and the others start when its first
chunk is out, by which time the prompt's full KV blocks are in the prefix cache of the
worker that computed them (and announced to the scheduler's router), so the others compute
only the prompt's last partial block. Disaggregated, they are placed by prefix like any
request: on the same prefill worker when the router sees the blocks there.

``merged`` owns the n backend streams: it yields ``(choice index, chunk)`` in the order the
chunks arrive and closes every stream (cancelling its request) when it is closed itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence

from engine.errors import EngineError
from services.gateway.backend import GenerateChunk, GenerateInput

MAX_N = 16  # choices per request: each is a whole generation


class StreamEndedEarly(EngineError):
    """A backend stream stopped before its last chunk (a backend fault, reported as such)."""


_SEED_SPAN = 2**64


def choice_inputs(inp: GenerateInput, n: int) -> list[GenerateInput]:
    """The ``n`` requests behind one request of ``n`` choices (``inp`` itself when 1)."""
    if n == 1:
        return [inp]
    out = []
    for i in range(n):
        seed = inp.params.seed
        params = inp.params
        if seed is not None:
            params = dataclasses.replace(params, seed=(seed + i) % _SEED_SPAN)
        out.append(dataclasses.replace(inp, request_id=f"{inp.request_id}-{i}", params=params))
    return out


async def to_last(stream: AsyncIterator[GenerateChunk]) -> AsyncIterator[GenerateChunk]:
    """``stream``'s chunks up to its last (the one with a finish reason), which ends it;
    a stream that stops before it raises ``StreamEndedEarly``. Every edge reads a backend
    stream through this (closing ``stream`` stays its caller's)."""
    async for chunk in stream:
        yield chunk
        if chunk.finish_reason is not None:
            return
    raise StreamEndedEarly("the backend ended the stream without a finish reason")


async def merged(
    streams: Sequence[Callable[[], AsyncIterator[GenerateChunk]]],
) -> AsyncIterator[tuple[int, GenerateChunk]]:
    """Run ``streams`` (factories, one per choice, started in order: choice 0 first, the
    rest once choice 0's first chunk is out) and yield each chunk with its choice's index
    until every choice's last chunk (the one with a finish reason) is out. An error in any
    stream ends the whole (it is raised here), and so does a stream that ends without its
    last chunk (``StreamEndedEarly``); closing this generator closes every stream."""
    if len(streams) == 1:
        async for chunk in to_last(streams[0]()):
            yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, GenerateChunk | Exception | None]] = asyncio.Queue()
    opened: list[AsyncIterator[GenerateChunk]] = []
    tasks: list[asyncio.Task[None]] = []

    async def pump(index: int, stream: AsyncIterator[GenerateChunk]) -> None:
        try:
            async for chunk in to_last(stream):
                queue.put_nowait((index, chunk))
            queue.put_nowait((index, None))  # its last chunk is out: the choice is done
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait((index, exc))

    def start(index: int) -> None:
        stream = streams[index]()
        opened.append(stream)
        tasks.append(asyncio.create_task(pump(index, stream)))

    try:
        start(0)
        running = 1
        while running:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                running -= 1
                continue
            if len(tasks) == 1:
                for i in range(1, len(streams)):
                    start(i)
                running += len(streams) - 1
            yield index, item
    finally:
        # Stop the pumps first (a stream cannot be closed while a task iterates it), then
        # close every stream, which cancels its request in the backend.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in opened:
            await _close(stream)


async def _close(stream: AsyncIterator[GenerateChunk]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()

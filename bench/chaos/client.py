"""One greedy streamed chat completion with its own deadline, as an ``Outcome``.

``chat`` never raises for the server's failure and never waits past its deadline: an HTTP
error, an error event in the stream, a stream that ends before ``[DONE]`` or a connection
error is a clean failure (``error`` set); passing the deadline cancels the request and
marks it ``hung``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp

from bench.serve.client import StreamError, sse_events

_MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class Outcome:
    """How request ``index`` (asking ``question``) ended. ``request_id``: the response's
    ``id``, which is the gateway's request id (empty if no chunk arrived)."""

    index: int
    question: str
    request_id: str
    text: str
    finish_reason: str | None
    error: str | None
    hung: bool
    seconds: float

    @property
    def completed(self) -> bool:
        return not self.hung and self.error is None


async def chat(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    question: str,
    *,
    index: int,
    max_tokens: int,
    deadline_s: float,
) -> Outcome:
    """Ask ``question`` at ``base_url`` (the ``/v1`` URL), greedy and streamed."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    started = time.monotonic()
    rid, text, finish, error, hung = "", [], None, None, False
    try:
        async with asyncio.timeout(deadline_s):
            async with session.post(f"{base_url}/chat/completions", json=body) as resp:
                if resp.status != 200:
                    detail = (await resp.text(errors="replace")).strip()
                    error = f"HTTP {resp.status}: {detail}"
                else:
                    async for event in sse_events(resp.content):
                        rid = rid or event.id
                        text.append(event.text)
                        finish = event.finish_reason or finish
    except StreamError as exc:
        error = str(exc)
    except TimeoutError:
        hung = True
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    return Outcome(
        index=index,
        question=question,
        request_id=rid,
        text="".join(text),
        finish_reason=finish,
        error=error[:_MAX_ERROR_CHARS] if error else None,
        hung=hung,
        seconds=time.monotonic() - started,
    )

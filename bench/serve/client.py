"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

``request_body`` builds the JSON (pure); ``parse_sse_line`` reads one server-sent-event
line (pure); ``send_request`` posts, reads the stream and returns a ``RequestRecord``.
It never raises for a server's failure: an HTTP error status, an error event in the
stream, a stream that ends before ``[DONE]``, a connection error or passing the deadline
each give a record with ``error`` set. The deadline covers the whole request.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from bench.serve.result import RequestRecord
from bench.serve.workload import RequestSpec

Endpoint = Literal["completions", "chat"]
PromptFormat = Literal["ids", "text"]
PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class ClientOptions:
    """How requests are sent.

    ``endpoint``: ``/v1/completions`` or ``/v1/chat/completions``. ``prompt_format``
    (completions only): token ids (``prompt: [ids]``) or text. ``ignore_eos``: the
    vLLM/llama-server extension that makes every output as long as ``max_tokens``.
    ``timeout_s``: deadline of each request, from send to the last byte. ``keep_text``:
    record the generated text (a conversation sends it back in its next turn).
    """

    endpoint: Endpoint = "completions"
    prompt_format: PromptFormat = "ids"
    ignore_eos: bool = True
    timeout_s: float = 300.0
    keep_text: bool = False


@dataclass(frozen=True)
class SseEvent:
    """What one ``data:`` line said. ``text``: the chunk's generated text (may be empty).
    ``pdserve``: pdserve's extension object (docs/api.md), in the usage chunk."""

    text: str = ""
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    error: str | None = None
    done: bool = False
    id: str = ""  # the chunk's ``id`` (the server's request id), "" if it has none
    pdserve: dict[str, Any] | None = None


class StreamError(Exception):
    """An SSE stream that failed: an error event, or an end before ``[DONE]``."""


async def sse_events(lines: AsyncIterator[bytes]) -> AsyncIterator[SseEvent]:
    """The data events of an OpenAI SSE stream, up to ``[DONE]``; ``StreamError`` on an
    error event or when the lines end before ``[DONE]``."""
    async for raw in lines:
        event = parse_sse_line(raw)
        if event is None:
            continue
        if event.done:
            return
        if event.error is not None:
            raise StreamError(f"stream error: {event.error}")
        yield event
    raise StreamError("the stream ended before [DONE]")


def request_body(spec: RequestSpec, model: str, opts: ClientOptions) -> dict[str, Any]:
    """The JSON body for ``spec``: streaming, usage included, greedy, ``max_tokens`` set."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.output_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.endpoint == "chat" and spec.messages:
        body["messages"] = [{"role": m.role, "content": m.content} for m in spec.messages]
    elif opts.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt_text}]
    elif opts.prompt_format == "ids":
        body["prompt"] = list(spec.prompt_ids)
    else:
        body["prompt"] = spec.prompt_text
    return body


def parse_sse_line(line: bytes | str) -> SseEvent | None:
    """One line of an SSE stream; ``None`` for blank lines, comments and non-data fields.

    Completions chunks carry ``choices[0].text``, chat chunks ``choices[0].delta.content``;
    ``usage`` may come in any chunk (OpenAI sends it in a last chunk with no choices). A
    body that is not JSON is an error event.
    """
    s = line.decode("utf-8", errors="replace") if isinstance(line, bytes) else line
    s = s.strip()
    if not s.startswith("data:"):
        return None
    data = s[5:].strip()
    if data == "[DONE]":
        return SseEvent(done=True)
    try:
        obj = json.loads(data)
    except json.JSONDecodeError:
        return SseEvent(error=f"not JSON in the stream: {data[:_MAX_ERROR_CHARS]}")
    if not isinstance(obj, dict):
        return SseEvent(error=f"unexpected stream event: {data[:_MAX_ERROR_CHARS]}")
    if obj.get("error"):
        err = obj["error"]
        message = err.get("message") if isinstance(err, dict) else None
        return SseEvent(error=str(message or err)[:_MAX_ERROR_CHARS])
    text, finish = "", None
    choices = obj.get("choices") or []
    if choices and isinstance(choices[0], dict):
        choice = choices[0]
        finish = choice.get("finish_reason")
        delta = choice.get("delta")
        content = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        text = content if isinstance(content, str) else ""
    usage = obj.get("usage")
    rid = obj.get("id")
    ext = obj.get("pdserve")
    return SseEvent(
        text=text,
        usage=usage if isinstance(usage, dict) else None,
        finish_reason=finish,
        id=rid if isinstance(rid, str) else "",
        pdserve=ext if isinstance(ext, dict) else None,
    )


def http_session() -> aiohttp.ClientSession:
    """The client session a benchmark sends through: no connection cap (the arrival pattern
    or the concurrency is the only limit), no session-wide timeout (each request has its
    own deadline), a 1 MiB read buffer (long SSE lines)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None),
        read_bufsize=1 << 20,
    )


async def send_request(
    session: aiohttp.ClientSession,
    root_url: str,
    spec: RequestSpec,
    *,
    index: int,
    model: str,
    opts: ClientOptions,
    t0: float,
    scheduled_s: float | None = None,
) -> RequestRecord:
    """Send ``spec`` to ``root_url`` (no ``/v1``) and time it against ``t0`` (a
    ``perf_counter`` reading); see the module docstring for how failures are recorded."""
    send_s = time.perf_counter() - t0
    times: list[float] = []
    texts: list[str] = []
    usage: dict[str, Any] | None = None
    ext: dict[str, Any] = {}
    status, error, finish = 0, None, None
    try:
        async with asyncio.timeout(opts.timeout_s):
            url = root_url + PATHS[opts.endpoint]
            async with session.post(url, json=request_body(spec, model, opts)) as resp:
                status = resp.status
                if status != 200:
                    body = await resp.text(errors="replace")
                    error = f"HTTP {status}: {body.strip()[:_MAX_ERROR_CHARS]}"
                else:
                    async for event in sse_events(resp.content):
                        # A first token that ends the request (EOS) has no text: the chunk
                        # that finishes the choice is its arrival.
                        if event.text or (event.finish_reason and not times):
                            times.append(time.perf_counter() - t0)
                            texts.append(event.text)
                        usage = event.usage or usage
                        ext = event.pdserve or ext
                        finish = event.finish_reason or finish
    except StreamError as exc:
        error = str(exc)
    except TimeoutError:
        error = f"timed out after {opts.timeout_s:g} s"
    except (aiohttp.ClientError, OSError, ValueError) as exc:  # ValueError: a line too long
        error = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS] or type(exc).__name__
    end_s = time.perf_counter() - t0
    return RequestRecord(
        index=index,
        tag=spec.tag,
        send_s=send_s,
        end_s=end_s,
        token_times_s=tuple(times),
        prompt_tokens=_usage_int(usage, "prompt_tokens", spec.prompt_tokens),
        completion_tokens=_usage_int(usage, "completion_tokens", len(times)),
        output_tokens_asked=spec.output_tokens,
        status=status,
        error=error,
        scheduled_s=scheduled_s,
        finish_reason=finish,
        cached_tokens=_int((usage or {}).get("prompt_tokens_details"), "cached_tokens"),
        kv_transfer_bytes=_int(ext, "kv_transfer_bytes"),
        prefill_worker_id=_str(ext, "prefill_worker_id"),
        decode_worker_id=_str(ext, "decode_worker_id"),
        session=spec.session,
        turn=spec.turn,
        output_text="".join(texts) if opts.keep_text else None,
    )


def _usage_int(usage: dict[str, Any] | None, key: str, fallback: int) -> int:
    value = _int(usage, key)
    return fallback if value is None else value


def _int(obj: object, key: str) -> int | None:
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(obj: object, key: str) -> str | None:
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, str) else None

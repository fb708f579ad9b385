"""OpenAI API responses: completion objects, stream chunks, usage and logprobs, SSE framing.

Pure builders of JSON-ready dicts in OpenAI's shapes: ``text_completion`` (completions, for
whole responses and stream chunks alike), ``chat.completion`` and ``chat.completion.chunk``.
A stream is ``sse(chunk)`` frames ending with ``SSE_DONE``.

pdserve's extension: whole responses and the usage chunk of a stream also carry a
``"pdserve"`` object (``extension``): the workers that served the request and the KV bytes
it moved between them. OpenAI clients ignore unknown keys.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from engine.tokenizer import Tokenizer
from engine.top_logprobs import TopLogprobs
from services.gateway.backend import ServedBy

SSE_DONE = b"data: [DONE]\n\n"
_MIN_LOGPROB = -9999.0  # JSON has no -Infinity; OpenAI clients expect a finite float


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return b"data: " + dumps(obj) + b"\n\n"


def dumps(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def extension(served_by: ServedBy) -> dict[str, Any]:
    """The ``"pdserve"`` object: ``kv_transfer_bytes`` (KV the prefill worker wrote into the
    decode worker for this request), ``prefill_worker_id`` and ``decode_worker_id`` ("" and
    0 where there is none or the backend does not know)."""
    return {
        "kv_transfer_bytes": served_by.kv_transfer_bytes,
        "prefill_worker_id": served_by.prefill_worker_id,
        "decode_worker_id": served_by.decode_worker_id,
    }


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def _clamp(lp: float) -> float:
    return lp if lp >= _MIN_LOGPROB else _MIN_LOGPROB


def completion_logprobs(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    text_offset: int,
    top: Sequence[TopLogprobs] = (),
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for these tokens; offsets start at
    ``text_offset`` (the length of the text returned before them). ``top``: each token's
    step's most likely tokens (``logprobs`` N > 0), given as ``top_logprobs``, one
    ``{token text: logprob}`` per token holding those and the sampled token (as OpenAI and
    vLLM do, so up to N + 1 entries); without them ``top_logprobs`` is null."""
    tokens = [_token_text(tokenizer, t) for t in token_ids]
    offsets = []
    for tok in tokens:
        offsets.append(text_offset)
        text_offset += len(tok)
    tops = None
    if top:
        tops = []
        for t, lp, step in zip(token_ids, logprobs, top, strict=True):
            alternatives = {
                _token_text(tokenizer, a): _clamp(alp)
                for a, alp in zip(step.token_ids, step.logprobs, strict=True)
            }
            alternatives.setdefault(_token_text(tokenizer, t), _clamp(lp))
            tops.append(alternatives)
    return {
        "tokens": tokens,
        "token_logprobs": [_clamp(lp) for lp in logprobs],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _chat_token(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    raw = tokenizer.token_bytes(token_id)
    return {
        "token": raw.decode("utf-8", errors="replace"),
        "logprob": _clamp(logprob),
        "bytes": list(raw),
    }


def chat_logprobs(
    tokenizer: Tokenizer,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[TopLogprobs] = (),
) -> dict[str, Any]:
    """The chat ``logprobs`` object: one entry per token; ``top`` (``top_logprobs`` > 0):
    each token's step's most likely tokens, most likely first, as its ``top_logprobs``
    (empty lists without them)."""
    steps: Sequence[TopLogprobs | None] = top or [None] * len(token_ids)
    content = []
    for t, lp, step in zip(token_ids, logprobs, steps, strict=True):
        entry = _chat_token(tokenizer, t, lp)
        entry["top_logprobs"] = (
            []
            if step is None
            else [
                _chat_token(tokenizer, a, alp)
                for a, alp in zip(step.token_ids, step.logprobs, strict=True)
            ]
        )
        content.append(entry)
    return {"content": content}


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One entry of a ``text_completion``'s ``choices``."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion(
    id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    pdserve: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``text_completion`` object (``choices`` from ``completion_choice``): a whole
    response (with usage and the ``pdserve`` extension) or one stream chunk."""
    obj: dict[str, Any] = {
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        obj["usage"] = usage
    if pdserve is not None:
        obj["pdserve"] = pdserve
    return obj


def chat_choice(
    index: int,
    message: dict[str, Any],
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One entry of a whole ``chat.completion``'s ``choices``; ``message`` is the assistant
    message (``{"role": "assistant", "content": ...}``, and ``tool_calls`` when it called)."""
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_completion(
    id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, Any],
    pdserve: dict[str, Any],
) -> dict[str, Any]:
    """A whole ``chat.completion`` response (``choices`` from ``chat_choice``), with the
    ``pdserve`` extension."""
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
        "pdserve": pdserve,
    }


def chat_chunk(
    id: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """One ``chat.completion.chunk`` of choice ``index``; ``delta`` is {"role": ...}
    and/or {"content": ...} (or ``tool_calls``)."""
    return {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        ],
    }


def usage_chunk(
    id: str, created: int, model: str, obj: str, usage: dict[str, Any], pdserve: dict[str, Any]
) -> dict[str, Any]:
    """The extra last chunk ``stream_options.include_usage`` asks for: no choices, usage and
    the ``pdserve`` extension."""
    return {
        "id": id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage,
        "pdserve": pdserve,
    }


def stream_error(message: str, code: str = "internal_error") -> dict[str, Any]:
    """What a stream sends when generation fails after the response started."""
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}

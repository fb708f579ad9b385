"""Workloads: the requests a benchmark sends, as ``RequestSpec`` lists (pure builders).

- ``build_fixed``: every request has the same prompt and output length.
- ``build_dist``: prompt and output lengths drawn (seeded) from ``Uniform`` or ``LogNormal``.
- ``build_interference``: ``streams`` steady decode streams (short prompt, long output)
  starting at t≈0, staggered by ``stream_stagger_s``, plus long prompts (short output)
  arriving on a schedule: the first at ``long_start_s``, then one every ``long_every_s``;
  ``long_count`` of them, or with ``long_count=None`` for as long as a stream is still
  running. Streams are tagged ``"stream"``, long prompts ``"long"``, everything else
  ``"request"``; the metrics split by tag.

Conversations (multi-turn, shared system prompts) are built in ``bench.serve.sessions``.

Schedule-driven workloads give each request its ``start_offset_s`` (seconds after the run
starts); the others leave it ``None`` and the runner's arrival pattern decides. Prompt
lengths are exact (see ``bench.serve.prompts``); each prompt opens with a fresh nonce.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

from bench.serve.prompts import PromptFactory
from engine.tokenizer import Tokenizer

TAG_REQUEST = "request"
TAG_STREAM = "stream"
TAG_LONG = "long"
MAX_SCHEDULED_LONG = 10_000


@dataclass(frozen=True)
class ChatMessage:
    """One message of a chat request (``role``: system, user or assistant)."""

    role: str
    content: str


@dataclass(frozen=True)
class RequestSpec:
    """One request to send.

    ``prompt_ids`` are the exact tokens the server evaluates (for chat, the templated
    prompt); ``prompt_text`` is the text form (for chat, the user message). ``output_tokens``
    is the ``max_tokens`` asked for. ``start_offset_s``: when to send it, seconds after the
    run starts (``None``: the arrival pattern decides). ``while_tag``: send it only while a
    request with this tag is still unfinished (otherwise it is dropped, not sent).

    Conversations (``sessions``): ``messages`` is the whole chat to send instead of one user
    message of ``prompt_text``; its templated length is known only to the server, so
    ``prompt_ids`` may be empty. ``session`` and ``turn`` say where it belongs.
    """

    prompt_ids: tuple[int, ...]
    prompt_text: str
    output_tokens: int
    tag: str = TAG_REQUEST
    start_offset_s: float | None = None
    while_tag: str | None = None
    messages: tuple[ChatMessage, ...] = ()
    session: int | None = None
    turn: int | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class Uniform:
    """Integers uniform in ``[low, high]``."""

    low: int
    high: int

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclass(frozen=True)
class LogNormal:
    """``exp(N(ln median, sigma))`` rounded, clipped to ``[low, high]``."""

    median: float
    sigma: float
    low: int
    high: int

    def sample(self, rng: random.Random) -> int:
        value = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(self.high, max(self.low, value))


LengthDist = Uniform | LogNormal


def default_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer of ``path`` (GGUF file or HF directory), by default of pdserve's default
    model (``engine.checkpoint.default_model_path()``)."""
    from engine.checkpoint import default_model_path

    return Tokenizer.from_path(path if path is not None else default_model_path())


def build_fixed(
    tokenizer: Tokenizer,
    *,
    num_requests: int,
    prompt_tokens: int,
    output_tokens: int,
    seed: int = 0,
    chat: bool = False,
) -> list[RequestSpec]:
    """``num_requests`` requests of ``prompt_tokens`` prompt and ``output_tokens`` output."""
    _check_positive(num_requests=num_requests, output_tokens=output_tokens)
    prompts = PromptFactory(tokenizer, seed=seed, chat=chat)
    return [
        RequestSpec(p.ids, p.text, output_tokens)
        for p in (prompts.make(prompt_tokens) for _ in range(num_requests))
    ]


def build_dist(
    tokenizer: Tokenizer,
    *,
    num_requests: int,
    prompt_dist: LengthDist,
    output_dist: LengthDist,
    seed: int = 0,
    chat: bool = False,
) -> list[RequestSpec]:
    """``num_requests`` requests with lengths drawn from the two distributions (seeded)."""
    _check_positive(num_requests=num_requests)
    for name, dist in (("prompt_dist", prompt_dist), ("output_dist", output_dist)):
        if not 1 <= dist.low <= dist.high:
            raise ValueError(f"{name}: need 1 <= low <= high, got {dist}")
    rng = random.Random(seed)
    prompts = PromptFactory(tokenizer, seed=seed, chat=chat)
    specs = []
    for _ in range(num_requests):
        n_prompt = max(prompts.min_tokens, prompt_dist.sample(rng))
        p = prompts.make(n_prompt)
        specs.append(RequestSpec(p.ids, p.text, output_dist.sample(rng)))
    return specs


def build_interference(
    tokenizer: Tokenizer,
    *,
    streams: int = 8,
    stream_prompt_tokens: int = 32,
    stream_output_tokens: int = 256,
    long_prompt_tokens: int = 1024,
    long_output_tokens: int = 16,
    long_start_s: float = 2.0,
    long_every_s: float = 4.0,
    long_count: int | None = None,
    seed: int = 0,
    stream_stagger_s: float = 0.01,
    horizon_s: float = 600.0,
    chat: bool = False,
) -> list[RequestSpec]:
    """Steady decode streams plus long prompts on a schedule (see the module docstring).

    Stream ``i`` starts at ``i * stream_stagger_s``; long prompt ``k`` at
    ``long_start_s + k * long_every_s``. With ``long_count=None`` long prompts are scheduled
    up to ``horizon_s`` and carry ``while_tag="stream"``, so the runner sends them only while
    a stream is still running. Returned in start order.
    """
    _check_positive(
        streams=streams,
        stream_output_tokens=stream_output_tokens,
        long_output_tokens=long_output_tokens,
        long_every_s=long_every_s,
    )
    if long_start_s < 0 or stream_stagger_s < 0:
        raise ValueError("long_start_s and stream_stagger_s must be >= 0")
    if long_count is None:
        n_long = math.floor((horizon_s - long_start_s) / long_every_s) + 1
        if n_long > MAX_SCHEDULED_LONG:
            raise ValueError(f"{n_long} long prompts before horizon_s: raise long_every_s")
    elif long_count < 0:
        raise ValueError(f"long_count must be >= 0, got {long_count}")
    else:
        n_long = long_count
    prompts = PromptFactory(tokenizer, seed=seed, chat=chat)
    specs = []
    for i in range(streams):
        p = prompts.make(stream_prompt_tokens)
        specs.append(
            RequestSpec(p.ids, p.text, stream_output_tokens, TAG_STREAM, i * stream_stagger_s)
        )
    while_tag = TAG_STREAM if long_count is None else None
    for k in range(max(0, n_long)):
        p = prompts.make(long_prompt_tokens)
        offset = long_start_s + k * long_every_s
        specs.append(RequestSpec(p.ids, p.text, long_output_tokens, TAG_LONG, offset, while_tag))
    specs.sort(key=lambda s: s.start_offset_s or 0.0)
    return specs


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")

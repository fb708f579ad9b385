"""Replay a Mooncake trace (``bench.serve.trace``): which requests, when, and with which
prompts, as ``RequestSpec`` lists (pure builders).

1. Sample (``sample=N``): a seeded choice of N groups, a group being the requests that share
   their first hash id (a conversation's turns, or every conversation over one shared system
   prompt), with every request of each. Requests share a prefix only if they share a first
   id, so the kept requests share exactly what they shared in the trace.
2. Schedule: in timestamp order; the first kept request goes at t=0 and every gap is the
   trace's gap times ``time_scale`` (above 1: slower than recorded).
3. Caps: requests scheduled at ``duration_s`` or later, and those past the first
   ``max_requests``, are left out (a conversation loses its later turns before its earlier
   ones).
4. Scale lengths by ``token_divisor`` D: a prompt of ``round(input_length / D)`` tokens, an
   output of ``round(output_length / D)`` (at least 1 each), blocks of ``512 / D`` tokens.
5. Prompts (``BlockWords``): hash id ``h`` stands for a block of single-token words drawn
   from a generator seeded by ``h`` and a per-run nonce. A prompt is its hash ids' blocks in
   order, cut to its length (the last block may be partial), and words of its own past them.
   Equal leading ids give byte-identical leading tokens; different ids different ones (a
   collision needs a whole block of equal draws). The nonce comes from the operating
   system, so two runs never hit each other's cached blocks.

Requests are sent as token ids: each prompt's length is exact (``prompts`` explains why its
text form has the same length). A request is tagged ``seen-prefix`` when its prompt opens
with tokens an earlier request of the replay sent, else ``new-prefix``; ``session`` is its
group's number in the replay and ``turn`` its place in the group.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from bench.serve.prompts import bos_prefix, single_token_words
from bench.serve.trace import BLOCK_TOKENS, TraceRequest
from bench.serve.workload import RequestSpec
from engine.tokenizer import Tokenizer

TAG_NEW_PREFIX = "new-prefix"
TAG_SEEN_PREFIX = "seen-prefix"


@dataclass(frozen=True)
class ReplayOptions:
    """How to fit a trace to this host (module docstring). ``None`` caps nothing."""

    token_divisor: int = 16
    time_scale: float = 1.0
    sample: int | None = None
    seed: int = 0
    max_requests: int | None = 1000
    duration_s: float | None = 600.0

    def __post_init__(self) -> None:
        d = self.token_divisor
        if not 1 <= d <= BLOCK_TOKENS or BLOCK_TOKENS % d:
            raise ValueError(f"the token divisor must divide {BLOCK_TOKENS}, got {d}")
        if not 0 < self.time_scale < math.inf:
            raise ValueError(f"the time scale must be positive, got {self.time_scale}")
        for name in ("sample", "max_requests", "duration_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")

    @property
    def block_tokens(self) -> int:
        return BLOCK_TOKENS // self.token_divisor

    def scaled(self, tokens: int) -> int:
        """``tokens / token_divisor`` rounded half up, at least 1."""
        return max(1, (2 * tokens + self.token_divisor) // (2 * self.token_divisor))


@dataclass(frozen=True)
class Scheduled:
    """A request of the trace kept for the replay, and when to send it (s after t=0)."""

    offset_s: float
    request: TraceRequest


def _group_keys(trace: Sequence[TraceRequest]) -> list[tuple[str, int]]:
    """Each request's group: its first hash id, or itself when it has none."""
    return [("id", r.group) if r.group is not None else ("line", i) for i, r in enumerate(trace)]


def select(trace: Sequence[TraceRequest], opts: ReplayOptions) -> list[Scheduled]:
    """Steps 1-3 of the module docstring: the kept requests with their send times, in order."""
    keys = _group_keys(trace)
    kept = list(range(len(trace)))
    if opts.sample is not None:
        groups = list(dict.fromkeys(keys))
        chosen = set(random.Random(opts.seed).sample(groups, min(opts.sample, len(groups))))
        kept = [i for i in kept if keys[i] in chosen]
    ordered = sorted(kept, key=lambda i: trace[i].timestamp_ms)
    if not ordered:
        return []
    start = trace[ordered[0]].timestamp_ms
    out = []
    for i in ordered:
        offset = (trace[i].timestamp_ms - start) / 1000.0 * opts.time_scale
        if opts.duration_s is not None and offset >= opts.duration_s:
            break
        out.append(Scheduled(offset, trace[i]))
    return out[: opts.max_requests]


class BlockWords:
    """The words of each hash id's block for one run (``nonce``), made once and kept."""

    def __init__(self, tokenizer: Tokenizer, block_tokens: int, nonce: str) -> None:
        self._pool = single_token_words(tokenizer)
        self._block_tokens = block_tokens
        self._nonce = nonce
        self._blocks: dict[int, tuple[int, ...]] = {}

    def block(self, hash_id: int) -> tuple[int, ...]:
        words = self._blocks.get(hash_id)
        if words is None:
            rng = random.Random(f"{self._nonce}/block/{hash_id}")
            words = tuple(rng.choices(self._pool, k=self._block_tokens))
            self._blocks[hash_id] = words
        return words

    def prompt_words(self, hash_ids: Sequence[int], n_words: int, own: str) -> list[int]:
        """``n_words`` words: the blocks of ``hash_ids`` in order, then words seeded by
        ``own`` (the request's own, shared with no one) where the blocks run out."""
        words: list[int] = []
        for h in hash_ids:
            if len(words) >= n_words:
                break
            words += self.block(h)
        if len(words) < n_words:
            rng = random.Random(f"{self._nonce}/own/{own}")
            words += rng.choices(self._pool, k=n_words - len(words))
        return words[:n_words]


class _SeenPrefixes:
    """The block-id prefixes earlier requests sent, and how many words of each last block."""

    def __init__(self) -> None:
        self._nodes: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> node
        self._words: list[int] = [0]  # node -> most words of its block sent so far

    def add(self, hash_ids: Sequence[int], n_words: int, block_tokens: int) -> int:
        """Record a prompt; return how many of its leading words an earlier one sent."""
        node, seen, matching = 0, 0, True
        for k, h in enumerate(hash_ids):
            in_block = min(block_tokens, n_words - k * block_tokens)
            if in_block <= 0:
                break
            child = self._nodes.get((node, h))
            if child is None:
                child = self._nodes[node, h] = len(self._words)
                self._words.append(0)
            if matching:
                seen += min(in_block, self._words[child])
                matching = self._words[child] >= in_block
            self._words[child] = max(self._words[child], in_block)
            node = child
        return seen


@dataclass(frozen=True)
class TraceStats:
    """What the replay sends, beside what the trace held (JSON-ready with ``to_dict``).

    ``reusable_tokens``: prompt tokens that open the same way in an earlier request of the
    replay, what an unbounded prefix cache could skip; ``reusable_share`` is their share of
    the prompt tokens, the ceiling for the cached share a server reports.
    """

    trace_requests: int
    trace_groups: int
    requests: int
    groups: int
    span_s: float
    prompt_tokens: int
    output_tokens: int
    reusable_tokens: int
    max_prompt_tokens: int
    block_tokens: int

    @property
    def reusable_share(self) -> float | None:
        return self.reusable_tokens / self.prompt_tokens if self.prompt_tokens else None

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "reusable_share": self.reusable_share}


def build_trace(
    tokenizer: Tokenizer,
    trace: Sequence[TraceRequest],
    opts: ReplayOptions,
    *,
    nonce: str | None = None,
) -> tuple[list[RequestSpec], TraceStats]:
    """The requests of the replay in send order (module docstring), and their stats.

    ``nonce``: the run's block seed (default: fresh from the operating system; tests fix it).
    """
    kept = select(trace, opts)
    if not kept:
        raise ValueError("the trace has no request to send")
    if nonce is None:
        nonce = f"{random.SystemRandom().getrandbits(64):016x}"
    words = BlockWords(tokenizer, opts.block_tokens, nonce)
    prefix = bos_prefix(tokenizer)
    seen = _SeenPrefixes()
    session_of: dict[tuple[str, int], int] = {}
    turns: dict[int, int] = {}
    specs: list[RequestSpec] = []
    reusable = 0
    keys = _group_keys([k.request for k in kept])
    for index, (s, key) in enumerate(zip(kept, keys, strict=True)):
        r = s.request
        n_words = max(1, opts.scaled(r.input_length) - len(prefix))
        ids = (*prefix, *words.prompt_words(r.hash_ids, n_words, own=str(index)))
        shared = seen.add(r.hash_ids, n_words, opts.block_tokens)
        reusable += (len(prefix) + shared) if shared else 0
        session = session_of.setdefault(key, len(session_of))
        turn = turns[session] = turns.get(session, -1) + 1
        specs.append(RequestSpec(
            prompt_ids=ids,
            prompt_text=tokenizer.decode(ids[len(prefix):]),
            output_tokens=opts.scaled(r.output_length),
            tag=TAG_SEEN_PREFIX if shared else TAG_NEW_PREFIX,
            start_offset_s=s.offset_s,
            session=session,
            turn=turn,
        ))  # fmt: skip
    stats = TraceStats(
        trace_requests=len(trace),
        trace_groups=len(set(_group_keys(trace))),
        requests=len(specs),
        groups=len(session_of),
        span_s=kept[-1].offset_s,
        prompt_tokens=sum(s.prompt_tokens for s in specs),
        output_tokens=sum(s.output_tokens for s in specs),
        reusable_tokens=reusable,
        max_prompt_tokens=max(s.prompt_tokens for s in specs),
        block_tokens=opts.block_tokens,
    )
    return specs, stats

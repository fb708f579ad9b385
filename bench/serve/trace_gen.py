"""Synthetic traces in Mooncake's format (``bench.serve.trace``), for
``pdserve bench --workload trace``: ``python -m bench.serve.trace_gen --out FILE``.

What ``generate`` makes, the same for the same ``TraceShape`` (seed included):

- ``conversations`` conversations start at Poisson arrivals, ``rate`` a second, the first
  at t=0. Each has ``turns`` turns (uniform in [MIN, MAX]); turn k+1 arrives an exponential
  think time (mean ``think_s``) after turn k, whatever the server does (open loop).
- Turn 0's prompt is a system prompt, then the user's first message (lognormal, median
  ``first_user_tokens``); turn k+1's prompt is turn k's, its answer (turn k's
  ``output_length``) and a new message (lognormal, median ``user_tokens``). Its hash ids
  extend turn k's: the block that was partial in turn k keeps its id as it fills.
- With probability ``shared_fraction`` a conversation opens with one of ``system_prompts``
  shared system prompts (``system_blocks`` whole blocks each, so their ids are shared
  across conversations), otherwise straight with its first message.
- Outputs are lognormal (median ``output_tokens``); every length draw has ``sigma``. A
  conversation ends early once its next prompt would pass ``max_input_tokens``.

Lengths are Mooncake-sized (thousands of tokens): the replay's ``--trace-token-divisor``
fits a generated trace to a host the way it fits a real one. The defaults make a run of
about three minutes at the replay's defaults on a 2-vCPU host serving a 135M model.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from bench.serve.arrival import Poisson, open_loop_offsets
from bench.serve.trace import BLOCK_TOKENS, TraceRequest, write_trace
from bench.serve.workload import LogNormal


@dataclass(frozen=True)
class TraceShape:
    """What a generated trace looks like (module docstring); lengths in trace tokens."""

    conversations: int = 32
    turns: tuple[int, int] = (2, 6)
    rate: float = 0.25
    think_s: float = 10.0
    system_prompts: int = 4
    system_blocks: int = 2
    shared_fraction: float = 0.5
    first_user_tokens: int = 2000
    user_tokens: int = 300
    output_tokens: int = 250
    sigma: float = 0.7
    max_input_tokens: int = 16384
    seed: int = 0

    def __post_init__(self) -> None:
        low, high = self.turns
        if not 1 <= low <= high:
            raise ValueError(f"turns: need 1 <= MIN <= MAX, got {low}, {high}")
        if not 0.0 <= self.shared_fraction <= 1.0:
            raise ValueError(f"shared_fraction must be in [0, 1], got {self.shared_fraction}")
        if self.system_prompts < 0 or self.system_blocks < 0:
            raise ValueError("system_prompts and system_blocks must be >= 0")
        for name in ("conversations", "rate", "think_s", "first_user_tokens", "user_tokens",
                     "output_tokens", "sigma"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_input_tokens <= self.system_blocks * BLOCK_TOKENS:
            raise ValueError("max_input_tokens must exceed a system prompt's tokens")


def _blocks(tokens: int) -> int:
    return math.ceil(tokens / BLOCK_TOKENS)


def generate(shape: TraceShape) -> list[TraceRequest]:
    """The trace ``shape`` describes, in timestamp order (module docstring)."""
    rng = random.Random(f"trace_gen/{shape.seed}")
    starts = open_loop_offsets(Poisson(shape.rate, shape.seed), shape.conversations)
    next_id = 0

    def new_ids(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    systems = [new_ids(shape.system_blocks) for _ in range(shape.system_prompts)]
    system_tokens = shape.system_blocks * BLOCK_TOKENS
    out: list[tuple[float, int, TraceRequest]] = []
    for conv, start in enumerate(starts):
        shared = bool(systems) and rng.random() < shape.shared_fraction
        ids = list(rng.choice(systems)) if shared else []
        opening = system_tokens if shared else 0
        first = LogNormal(shape.first_user_tokens, shape.sigma, 1,
                          shape.max_input_tokens - opening)  # fmt: skip
        later = LogNormal(shape.user_tokens, shape.sigma, 1, shape.max_input_tokens)
        output = LogNormal(shape.output_tokens, shape.sigma, 1, 8 * shape.output_tokens)
        t, tokens = start, opening + first.sample(rng)
        for _ in range(rng.randint(*shape.turns)):
            ids += new_ids(_blocks(tokens) - len(ids))
            answer = output.sample(rng)
            out.append((t, conv, TraceRequest(float(round(t * 1000)), tokens, answer, tuple(ids))))
            t += rng.expovariate(1.0 / shape.think_s)
            tokens += answer + later.sample(rng)
            if tokens > shape.max_input_tokens:
                break
    return [r for _, _, r in sorted(out, key=lambda x: (x[0], x[1]))]


def build_parser() -> argparse.ArgumentParser:
    d = TraceShape()
    p = argparse.ArgumentParser(
        prog="python -m bench.serve.trace_gen",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    p.add_argument("--turns", type=int, nargs=2, metavar=("MIN", "MAX"), default=d.turns,
                   help="turns a conversation, uniform (default: %(default)s)")  # fmt: skip
    helps = {
        "conversations": "conversations",
        "rate": "conversations starting a second (Poisson)",
        "think_s": "mean seconds between a conversation's turns (exponential)",
        "system_prompts": "shared system prompts",
        "system_blocks": "512-token blocks of a shared system prompt",
        "shared_fraction": "share of conversations that open with a shared system prompt",
        "first_user_tokens": "median tokens of a conversation's first message",
        "user_tokens": "median tokens of each later message",
        "output_tokens": "median output tokens",
        "sigma": "sigma of ln(length) of every length drawn",
        "max_input_tokens": "a conversation ends before its prompt would pass this",
        "seed": "seeds everything: the same seed writes the same trace",
    }
    for f in fields(TraceShape):
        if f.name in helps:
            default = getattr(d, f.name)
            p.add_argument("--" + f.name.replace("_", "-"), type=type(default), default=default,
                           help=f"{helps[f.name]} (default: %(default)s)")  # fmt: skip
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    values = {f.name: getattr(args, f.name) for f in fields(TraceShape)}
    try:
        shape = TraceShape(**{**values, "turns": tuple(values["turns"])})
    except ValueError as exc:
        print(f"trace_gen: {exc}", file=sys.stderr)
        return 2
    trace = generate(shape)
    write_trace(args.out, trace)
    span_s = trace[-1].timestamp_ms / 1000
    print(f"wrote {len(trace)} requests of {shape.conversations} conversations over "
          f"{span_s:.0f} s to {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

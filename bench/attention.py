"""The CPU decode attention kernel by KV dtype, its pools in memory and in cache.

One "step" is the kernel run once per layer, as a decode step runs it: B sequences of
``--context`` tokens, the default model's heads (9 query, 3 kv, head dim 64). Two placements:

- ``memory``: every layer has its own pools, their blocks scattered at random, so each
  step reads all of its KV from DRAM (what serving sees at batch 8 and up);
- ``cache``: one layer's small pool, every sequence's table naming the same blocks, so the
  KV stays cache-resident: the arithmetic alone.

The dtypes take turns repeat by repeat (the host's speed drifts by a third within minutes);
reported: each placement's and dtype's median ms per step, and float16 ÷ float32 per repeat.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from bench._common import machine_info, markdown_table, median, write_json

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
DTYPES = {"float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class Figure:
    placement: str  # memory or cache
    dtype: str
    step_ms: tuple[float, ...]  # one per repeat

    @property
    def median_ms(self) -> float:
        return median(self.step_ms)


def _pools(
    gen: torch.Generator, layers: int, num_blocks: int, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    return [
        (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
        for _ in range(layers)
    ]


def run(
    *, threads: int, batch: int, context: int, layers: int, repeats: int, seed: int
) -> list[Figure]:
    from kernels.paged_attention import decode_attention_cpu

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // BLOCK)
    scattered = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq).contiguous()
    shared = torch.arange(per_seq).repeat(batch, 1).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int64)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    cases = {}
    for name, dtype in DTYPES.items():
        cases["memory", name] = (_pools(gen, layers, batch * per_seq, dtype), scattered)
        one = _pools(gen, 1, per_seq, dtype)
        cases["cache", name] = (one * layers, shared)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in cases}
    for _ in range(repeats + 1):  # the first round is a warm-up (page faults, the build)
        for key, (pools, table) in cases.items():
            t0 = time.perf_counter()
            for k, v in pools:
                decode_attention_cpu(q, k, v, table, lens, HEAD_DIM**-0.5, ranges_checked=True)
            times[key].append(1000.0 * (time.perf_counter() - t0))
    return [Figure(p, d, tuple(t[1:])) for (p, d), t in times.items()]


def format_table(figures: Sequence[Figure]) -> str:
    by = {(f.placement, f.dtype): f for f in figures}
    rows = []
    for placement in ("memory", "cache"):
        wide, narrow = by[placement, "float32"], by[placement, "float16"]
        ratios = [n / w for n, w in zip(narrow.step_ms, wide.step_ms, strict=True)]
        rows.append(
            [
                placement,
                f"{wide.median_ms:.2f}",
                f"{narrow.median_ms:.2f}",
                f"{median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})",
            ]
        )
    header = ["KV", "float32 ms/step", "float16 ms/step", "float16 ÷ float32 (median, range)"]
    return markdown_table(header, rows)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="python -m bench.attention",
        description="CPU decode attention per step by KV dtype, from memory and from cache.",
    )
    p.add_argument("--threads", type=int, default=1, help="(default: 1)")
    p.add_argument("--batch", type=int, default=8, help="sequences (default: 8)")
    p.add_argument("--context", type=int, default=270, help="tokens each (default: 270)")
    p.add_argument("--layers", type=int, default=30, help="kernel calls a step (default: 30)")
    p.add_argument("--repeats", type=int, default=15, help="(default: 15)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="write results to this JSON file")
    args = p.parse_args(argv)
    for name in ("threads", "batch", "context", "layers", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    figures = run(
        threads=args.threads, batch=args.batch, context=args.context, layers=args.layers,
        repeats=args.repeats, seed=args.seed,
    )  # fmt: skip
    command = shlex.join(["python", "-m", "bench.attention", *argv])
    machine = machine_info()
    print(f"command: {command}")
    print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} CPUs")
    print(f"batch {args.batch}, context {args.context}, {args.layers} layers, {args.threads} thr")
    print()
    print(format_table(figures))
    if args.json:
        write_json(
            args.json,
            {"command": command, "machine": machine, "figures": [asdict(f) for f in figures]},
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

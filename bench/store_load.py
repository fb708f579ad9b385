"""Loading a prefix from the KV store against computing it: where the crossover lies.

One process, a private ``mooncake_master``, two engines on the default model with their
own pools and stores (the CPU engine settings workers use: float32 compute, float16 KV).
For each prefix length, engine A computes a prompt of random token ids (so nothing is
cached) and its blocks go to the store; then engine B, whose pool holds none of them,
(1) loads the prefix from the store (``kvstore.prefix.loaded_prefix``: lookup, read,
check, copy into its pool) and (2) with a cold cache, computes the same prefix
(``admit_prompt`` + ``run_prefill``). Each is timed ``--repeats`` times; the median is
reported. Loading wins at a length when its time is below computing's; the ratio per
token is what the scheduler's ``STORE_LOAD_TOKEN_COST`` stands for.

``python -m bench.store_load --help`` lists the options.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_LENGTHS = (16, 64, 256, 1024, 4096)


@dataclass(frozen=True)
class Row:
    tokens: int
    blocks: int
    load_ms: float
    compute_ms: float

    @property
    def per_token_ratio(self) -> float:
        return self.load_ms / self.compute_ms if self.compute_ms else float("nan")


async def _measure(lengths: Sequence[int], repeats: int, threads: int) -> list[Row]:
    import torch

    from engine.async_engine import AsyncEngine
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sampling_params import SamplingParams
    from kvstore.backend import MooncakeBackend, MooncakeOptions
    from kvstore.block_format import BlockFormat
    from kvstore.master_process import MooncakeMaster
    from kvstore.prefix import loaded_prefix
    from kvstore.store import KVStore

    torch.set_num_threads(threads)
    master = MooncakeMaster.start()
    config = EngineConfig(weights="float32", kv_cache_dtype="float16", threads=threads)
    a, b = LLMEngine(config), LLMEngine(config)
    stores = []
    try:
        for engine in (a, b):
            backend = MooncakeBackend(MooncakeOptions(master.address, "127.0.0.1", 1 << 30))
            store = KVStore(backend, BlockFormat.for_pool(engine.kv_spec, engine.model_digest))
            stores.append(store)
        store_a, store_b = stores
        a.kv_export = lambda hashes, blocks: store_a.offer(a.kv, hashes, blocks)
        aengine = AsyncEngine(b)
        aengine.start()
        params = SamplingParams(max_tokens=1, temperature=0.0)
        vocab = b.model_config.vocab_size
        rng = random.Random(0)
        rows = []
        for n in lengths:
            loads, computes = [], []
            for _ in range(repeats):
                ids = [rng.randrange(vocab) for _ in range(n + 1)]  # +1: the computed token
                a.generate([ids], params)
                if not store_a.flush(60.0):
                    raise RuntimeError("the store did not take the blocks in 60 s")
                await aengine.call(b.blocks.reset_prefix_cache)
                t0 = time.perf_counter()
                async with loaded_prefix(aengine, store_b, ids, timeout_s=30.0) as got:
                    loads.append(time.perf_counter() - t0)
                if got.tokens != n // b.kv_spec.block_size * b.kv_spec.block_size:
                    raise RuntimeError(f"loaded {got.tokens} of {n} tokens")
                await aengine.call(lambda: None)  # the hold is dropped
                await aengine.call(b.blocks.reset_prefix_cache)
                t0 = time.perf_counter()
                plan = await aengine.admit_prompt("c", ids[:n], params)
                await aengine.run_prefill(plan)
                computes.append(time.perf_counter() - t0)
                await aengine.release("c")
            blocks = n // b.kv_spec.block_size
            rows.append(Row(n, blocks, 1e3 * statistics.median(loads),
                            1e3 * statistics.median(computes)))  # fmt: skip
            print(f"bench.store_load: {n} tokens: load {rows[-1].load_ms:.1f} ms, compute "
                  f"{rows[-1].compute_ms:.1f} ms", file=sys.stderr, flush=True)  # fmt: skip
        await aengine.stop()
        return rows
    finally:
        for store in stores:
            store.close()
        master.stop()


def render(rows: Sequence[Row], command: str, threads: int) -> str:
    date = datetime.datetime.now(datetime.UTC).date().isoformat()
    lines = [
        f"- date: {date}; command: `{command}`; {threads} torch thread(s), float16 KV, one "
        "host (the store over Mooncake's TCP)",
        "",
        "| prefix tokens | blocks | load ms | compute ms | load / compute |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.tokens:,} | {r.blocks} | {r.load_ms:.1f} | {r.compute_ms:.1f} | "
            f"{r.per_token_ratio:.3f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.store_load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--lengths",
        type=lambda t: tuple(int(x) for x in t.split(",")),
        default=DEFAULT_LENGTHS,
        help=f"prefix lengths in tokens (default: {','.join(map(str, DEFAULT_LENGTHS))})",
    )
    p.add_argument("--repeats", type=int, default=3, help="(default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    args = p.parse_args(argv)
    if args.repeats < 1 or any(n < 16 for n in args.lengths):
        print("bench.store_load: repeats >= 1 and lengths >= 16 (one block)", file=sys.stderr)
        return 2
    rows = asyncio.run(_measure(args.lengths, args.repeats, args.threads))
    command = " ".join(["python -m bench.store_load", *(argv or sys.argv[1:])])
    print(render(rows, command, args.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measure a ``Profile`` in this process with pdserve's own engine (``LLMEngine``).

What is timed, on ``threads`` torch threads (set before any work), float32 by default:

- prefill(P): the engine's first step on a fresh random prompt of exactly P tokens, prefix
  caching off (``bench.engine._engine_prefill_s``, the engine benchmark's own timer); the
  median of ``repeats``.
- step(b, c): b sequences of c random prompt tokens join the running batch the way a decode
  worker's do, through ``reserve`` -> ``add_prefilled``, with their KV blocks filled with
  non-zero values instead of being prefilled (a batch of 32 x 1,024 tokens would otherwise
  cost minutes of prefill). One untimed step, then ``repeats`` runs of ``decode_steps``
  steps; the median per-step time. Each step must produce b tokens, with no preemption.
  Contexts grow by at most 1 + steps x repeats tokens while timed; the grid records c.
- KV transfer (``--transfer shm|tcp``, default shm): the KV of a ``max(prefill_tokens)``-token
  request pushed from the engine's pool into a region registered in this process, the way a
  prefill worker pushes it (``write_layer`` for every layer, then ``finish``); bytes moved /
  median seconds. In one process the tcp receiver shares the interpreter with the sender,
  so its figure is pessimistic; shm copies the same bytes a cross-process push does.
- KV bytes per token and the number of layers come from the engine's KV spec.

The default grid takes about a minute on one thread of the development machine.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from bench.plan.profile import Profile

DEFAULT_PREFILL_TOKENS = (128, 512, 1024)
DEFAULT_DECODE_BATCHES = (1, 8, 32)
DEFAULT_DECODE_CONTEXTS = (256, 1024)
TRANSFERS = ("shm", "tcp", "none")
_TRANSFER_DEADLINE_S = 60.0


@dataclass(frozen=True)
class ProfileConfig:
    """What ``measure_profile`` times. ``model`` None: the embedded default model."""

    threads: int = 1
    model: str | None = None
    dtype: str = "float32"
    prefill_tokens: tuple[int, ...] = DEFAULT_PREFILL_TOKENS
    decode_batches: tuple[int, ...] = DEFAULT_DECODE_BATCHES
    decode_contexts: tuple[int, ...] = DEFAULT_DECODE_CONTEXTS
    decode_steps: int = 8
    repeats: int = 2
    transfer: str = "shm"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prefill_tokens", "decode_batches", "decode_contexts"):
            values = getattr(self, name)
            if not values or any(v < 1 for v in values):
                raise ValueError(f"{name.replace('_', ' ')} must be non-empty integers >= 1")
            if list(values) != sorted(set(values)):
                raise ValueError(f"{name.replace('_', ' ')} must strictly increase")
        for name in ("threads", "decode_steps", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', ' ')} must be >= 1")
        if self.transfer not in TRANSFERS:
            raise ValueError(f"transfer must be one of {', '.join(TRANSFERS)}")


def _log(message: str) -> None:
    print(f"[pdserve plan profile] {message}", file=sys.stderr, flush=True)


def _timed_tokens(cfg: ProfileConfig) -> int:
    return 2 + cfg.decode_steps * cfg.repeats  # the decode steps' own growth


def _engine(cfg: ProfileConfig, ckpt: Any) -> Any:  # -> LLMEngine (torch stays lazy)
    """An engine with room for the longest prefill and the largest decode batch at the
    longest context; prefix caching off, so every prefill computes all of its tokens."""
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.tokenizer import Tokenizer

    block = 16
    per_seq = -(-(max(cfg.decode_contexts) + _timed_tokens(cfg) + 1) // block)
    num_blocks = 1 + max(
        -(-(max(cfg.prefill_tokens) + 1) // block), max(cfg.decode_batches) * per_seq
    )
    engine = LLMEngine(
        EngineConfig(
            dtype=cfg.dtype,
            kv_cache_dtype=cfg.dtype,
            block_size=block,
            num_kv_blocks=num_blocks,
            max_num_seqs=max(cfg.decode_batches),
            prefix_caching=False,
            threads=cfg.threads,
        ),
        checkpoint=ckpt,
        tokenizer=Tokenizer.from_path(ckpt.path),
    )
    # A fresh pool is calloc'd zero pages: reading them would time the cache, not memory.
    engine.kv.pool.fill_(0.01)
    return engine


def _time_steps(
    cfg: ProfileConfig,
    engine: Any,
    ids: Callable[[tuple[int, ...]], Any],
    log: Callable[[str], None],
) -> tuple[list[float], list[tuple[float, ...]]]:
    """Median seconds of each prefill length, and of a decode step per batch and context
    (rows: batches), each on fresh random ``ids`` of the shape asked."""
    from bench.engine import _engine_prefill_s

    prefill_s = []
    for tokens in cfg.prefill_tokens:
        runs = [_engine_prefill_s(engine, ids((tokens,)).tolist()) for _ in range(cfg.repeats)]
        prefill_s.append(statistics.median(runs))
        log(f"prefill {tokens} tokens: {prefill_s[-1] * 1e3:.1f} ms")

    step_s = []
    for batch in cfg.decode_batches:
        row = []
        for context in cfg.decode_contexts:
            prompts = ids((batch, context)).tolist()
            steps = cfg.decode_steps
            row.append(_decode_step_s(engine, prompts, steps, cfg.repeats, _timed_tokens(cfg)))
            log(f"decode batch {batch}, context {context}: {row[-1] * 1e3:.1f} ms/step")
        step_s.append(tuple(row))
    return prefill_s, step_s


def measure_profile(cfg: ProfileConfig, log: Callable[[str], None] = _log) -> Profile:
    """Measure and return a ``Profile`` (engine and model errors propagate as ``EngineError``).

    Sets torch's thread count for this process to ``cfg.threads``.
    """
    import torch

    from bench._common import load_average, machine_info
    from bench.engine import _Prompts
    from engine.checkpoint import load_checkpoint
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(cfg.threads)
    wall0 = time.perf_counter()
    load_before = load_average()
    ckpt = load_checkpoint(cfg.model, dtype=getattr(torch, cfg.dtype))
    engine = _engine(cfg, ckpt)
    ids = _Prompts(torch.Generator().manual_seed(cfg.seed), ckpt.config.vocab_size)
    warm = ids((min(128, max(cfg.prefill_tokens)),))
    engine.generate([warm.tolist()], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    log(f"loaded {ckpt.path.name} on {cfg.threads} thread(s)")
    prefill_s, step_s = _time_steps(cfg, engine, ids, log)

    rate = None
    if cfg.transfer != "none":
        rate = _transfer_bytes_per_s(engine, cfg.transfer, max(cfg.prefill_tokens), cfg.repeats)
        log(f"KV transfer over {cfg.transfer}: {rate / 1e9:.2f} GB/s")

    profile = Profile(
        prefill_tokens=tuple(cfg.prefill_tokens),
        prefill_s=tuple(prefill_s),
        decode_batches=tuple(cfg.decode_batches),
        decode_contexts=tuple(cfg.decode_contexts),
        decode_step_s=tuple(step_s),
        kv_bytes_per_token=engine.kv_spec.bytes_per_token,
        num_layers=engine.kv_spec.num_layers,
        kv_transfer_bytes_per_s=rate,
        kv_transfer_transport=None if rate is None else cfg.transfer,
        threads=cfg.threads,
        model=str(ckpt.path),
        dtype=cfg.dtype,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    del engine, ckpt
    gc.collect()
    machine = {
        **machine_info(),
        "load_before": list(load_before),
        "load_after": list(load_average()),
        "wall_s": round(time.perf_counter() - wall0, 3),
    }
    return replace(profile, machine=machine)


def _decode_step_s(
    engine: Any, prompts: list[list[int]], steps: int, repeats: int, max_tokens: int
) -> float:
    """Median seconds of one decode step of ``prompts`` joined as prefilled sequences."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    batch = len(prompts)
    rids = [f"plan-{time.monotonic_ns()}-{i}" for i in range(batch)]
    try:
        for rid, ids in zip(rids, prompts, strict=True):
            engine.reserve(rid, ids, params)
            engine.add_prefilled(rid, ids[-1], 0.0)  # token 0, as a prefill worker sends it
        preempted = engine.num_preemptions

        def one_step() -> None:
            outs = engine.step()
            if len(outs) != batch:
                raise RuntimeError(f"a decode step produced {len(outs)} tokens, expected {batch}")

        one_step()  # untimed: first call at this batch shape
        per_step = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(steps):
                one_step()
            per_step.append((time.perf_counter() - t0) / steps)
        if engine.num_preemptions != preempted:
            raise RuntimeError("the decode batch was preempted: the KV pool is too small")
        return statistics.median(per_step)
    finally:
        for rid in rids:
            engine.abort_request(rid)


def _transfer_bytes_per_s(engine: Any, transport_name: str, tokens: int, repeats: int) -> float:
    """Bytes/s of pushing one ``tokens``-token request's KV, every layer, over a transport."""
    from transfer import KVLayout, KVSource, get_transport

    src_layout = KVLayout.from_spec(engine.kv_spec)
    nblocks = engine.blocks.blocks_needed(tokens)
    dst_layout = replace(src_layout, num_blocks=nblocks)
    src = KVSource(engine.kv.as_bytes(), src_layout)
    ids = list(range(nblocks))
    with get_transport(transport_name) as transport:
        region = transport.register(dst_layout)
        try:
            region.tensor.zero_()  # touch the pages before timing
            writer = transport.connect(region.handle, src)
            times = []
            for i in range(repeats + 1):  # the first is a warm-up
                t0 = time.perf_counter()
                deadline = time.monotonic() + _TRANSFER_DEADLINE_S
                job = writer.begin(f"plan-xfer-{i}", ids, ids, deadline=deadline)
                for layer in range(src_layout.num_layers):
                    job.write_layer(layer)
                result = job.finish().result(_TRANSFER_DEADLINE_S)
                times.append(time.perf_counter() - t0)
            return result.bytes / statistics.median(times[1:])
        finally:
            region.close()

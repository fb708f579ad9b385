"""Engine flags shared by every command and service that runs an engine."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from services.common.config import cpu_list

if TYPE_CHECKING:
    from engine.llm_engine import EngineConfig


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-mib", type=int, default=1024, help="KV pool size in MiB")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument(
        "--chunked-prefill",
        type=int,
        default=0,
        metavar="TOKENS",
        help="split prompts into chunks of this many tokens (0: off)",
    )
    g.add_argument("--no-prefix-caching", action="store_true")


def add_worker_flags(p: argparse.ArgumentParser) -> None:
    """The threads of a worker process (prefill, decode): where the engine thread runs and
    how long the event loop may wait for the GIL."""
    g = p.add_argument_group("worker threads")
    g.add_argument(
        "--engine-cpus",
        type=cpu_list,
        default=None,
        metavar="CPUS",
        help="pin the engine thread (and the torch threads it starts) to these cores (comma "
        "list). The event loop, gRPC and KV sender threads keep all the process's cores, so "
        "with more cores than these they run beside a step's compute instead of waiting "
        "for the CPU (pdserve up --pin --control-cpus sets this to the worker's core and "
        "starts the worker on that core plus the control cores no worker computes on; "
        "default: not pinned)",
    )
    g.add_argument(
        "--switch-interval-ms",
        type=_positive_ms,
        default=0.5,
        metavar="MS",
        help="Python's thread switch interval. The engine thread holds the GIL in its Python "
        "parts; this bounds how long the gRPC/event-loop thread waits to send a token "
        "(Python's default is 5 ms; default here: %(default)s)",
    )


def _positive_ms(text: str) -> float:
    value = float(text)
    if not 0 < value <= 100:
        raise argparse.ArgumentTypeError(f"must be in (0, 100] ms, got {text}")
    return value


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from engine.llm_engine import EngineConfig  # lazy: keeps --help fast

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_mib << 20,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        chunked_prefill=args.chunked_prefill > 0,
        max_num_batched_tokens=args.chunked_prefill or None,
        enable_prefix_caching=not args.no_prefix_caching,
        num_threads=args.threads,
    )

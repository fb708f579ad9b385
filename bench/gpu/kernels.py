"""Triton paged decode attention against the device's copy bandwidth (issue 17's target).

    python -m bench.gpu.kernels                      # cuda: batch 64, context 4096, bf16
    TRITON_INTERPRET=1 python -m bench.gpu.kernels --device cpu --batch 2 --context 40 ...

Decode attention reads every cached key and value once, so its speed limit is memory
bandwidth. The figure is the kernel's achieved read bandwidth (K and V bytes of every
sequence's context per call) over the device's copy bandwidth (a ``copy_`` of a buffer the
size of those K and V bytes, counted as read + written), measured here on the same device.
The target is ≥ 0.70 at batch 64, context 4096. The output is checked against the torch
reference first: a kernel that is fast and wrong exits 1. On CPU it runs only under
``TRITON_INTERPRET=1`` (for tests; the times then mean nothing).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench._common import median, write_json

TARGET = 0.70
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def _timed(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` calls after one warm-up."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return median(times)


def run(args: argparse.Namespace) -> dict[str, object]:
    from kernels.triton.decode_attention import (
        paged_decode_attention,
        paged_decode_attention_reference,
    )

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-args.context // args.block_size)
    num_blocks = args.batch * per_seq
    pool_shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    k_pool = torch.randn(pool_shape, generator=gen).to(device, dtype)
    v_pool = torch.randn(pool_shape, generator=gen).to(device, dtype)
    q = torch.randn(args.batch, args.heads, args.head_dim, generator=gen).to(device, dtype)
    # Shuffled block ids: a real pool's sequences do not own neighbouring blocks.
    tables = torch.randperm(num_blocks, generator=gen).view(args.batch, per_seq)
    tables, lens = tables.to(device, torch.int32), torch.full((args.batch,), args.context)
    lens = lens.to(device, torch.int32)
    scale = args.head_dim**-0.5

    def attend() -> torch.Tensor:
        return paged_decode_attention(q, k_pool, v_pool, tables, lens, scale)

    error = (attend().float().cpu() - paged_decode_attention_reference(
        q, k_pool, v_pool, tables, lens, scale).float().cpu()).abs().max().item()  # fmt: skip
    kv_bytes = 2 * args.batch * args.context * args.kv_heads * args.head_dim * dtype.itemsize
    src = torch.empty(kv_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = _timed(lambda: dst.copy_(src), device, args.iters)
    attend_s = _timed(attend, device, args.iters)
    copy_gbs, attend_gbs = 2 * kv_bytes / copy_s / 1e9, kv_bytes / attend_s / 1e9
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": {
            k: getattr(args, k)
            for k in ("batch", "context", "heads", "kv_heads", "head_dim", "block_size", "dtype")
        },
        "max_abs_error": error,
        "tolerance": TOLERANCE[dtype],
        "kv_bytes": kv_bytes,
        "attention_ms": attend_s * 1e3,
        "attention_gbs": attend_gbs,
        "copy_gbs": copy_gbs,
        "ratio": attend_gbs / copy_gbs,
        "target": TARGET,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args(argv)
    if min(args.batch, args.context, args.heads, args.kv_heads, args.head_dim, args.iters) < 1:
        p.error("sizes and --iters must be >= 1")
    try:
        result = run(args)
    except ValueError as e:  # the launcher's refusal: say it as a usage error
        p.error(str(e))
    print(f"{result['device']}: decode attention {result['attention_ms']:.3f} ms, "
          f"{result['attention_gbs']:.1f} GB/s read; copy {result['copy_gbs']:.1f} GB/s; "
          f"ratio {result['ratio']:.2f} (target {TARGET:.2f}); "
          f"max |error| {result['max_abs_error']:.2e}")  # fmt: skip
    if args.json:
        write_json(args.json, result)
    if result["max_abs_error"] > result["tolerance"]:  # type: ignore[operator]
        print(f"wrong output: max |error| above {result['tolerance']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Small random paged-pool cases the Triton kernel tests share."""

from __future__ import annotations

import torch

# fp32: only summation order differs. bf16: inputs are the same bf16 numbers on both sides
# and both round one float32 result to bf16, so they differ by at most ~1 ulp (2**-8 rel).
TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2},
}


def pools(
    g: torch.Generator,
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, kv_heads, dim)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def shuffled_tables(
    g: torch.Generator, lens: list[int], block_size: int, num_blocks: int, dtype: torch.dtype
) -> torch.Tensor:
    """Distinct, shuffled block ids per row (unused tail slots padded with 0)."""
    max_blocks = max(-(-n // block_size) for n in lens)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(lens), max_blocks, dtype=dtype)
    used = 0
    for row, n in enumerate(lens):
        nb = -(-n // block_size)
        table[row, :nb] = perm[used : used + nb]
        used += nb
    return table


def blocks_needed(lens: list[int], block_size: int) -> int:
    return sum(-(-n // block_size) for n in lens)


def on(device: torch.device, args: dict[str, object]) -> dict[str, object]:
    """``args`` with its CPU tensors moved to ``device`` (others, like a meta tensor, stay)."""
    return {
        name: t.to(device) if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t
        for name, t in args.items()
    }

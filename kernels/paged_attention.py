"""Checking launchers for paged decode attention kernels.

``decode_attention_cpu`` runs ``csrc/paged_decode_attention.cpp``: it reads each
sequence's keys and values in place from the pool's blocks, where the torch reference
(``kernels/reference.py``) first gathers them into a contiguous copy. The extension is
compiled on first use (``kernels/extension.py``); if that is impossible the engine keeps
the reference path.
The engine's ``cpu_kernels`` setting decides whether it is asked at all.
"""

from __future__ import annotations

import torch

from kernels.extension import Extension

# The pool dtypes the kernel reads (float16 is widened to float32 as it is loaded).
POOL_DTYPES = (torch.float32, torch.float16)

_EXTENSION = Extension("paged_decode_attention", ("-fopenmp-simd", "-fno-math-errno"))


def cpu_kernel_available() -> bool:
    return _EXTENSION.load() is not None


def decode_attention_cpu(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    ranges_checked: bool = False,
) -> torch.Tensor:
    """Paged decode attention; returns ``[B, heads, head_dim]``.

    ``ranges_checked``: the caller has checked this batch's ``context_lens`` and
    ``block_tables`` against the pool once for all layers (``check_decode_ranges``), so the
    per-call reductions are skipped; shapes and dtypes are still checked.

    Contract: ``q`` is ``[B, heads, D]``; ``k_pool``/``v_pool`` one layer's
    ``[num_blocks, block_size, kv_heads, D]``; ``block_tables`` ``[B, max_blocks]`` covers
    ``context_lens[b]`` tokens for every row; ``q`` float32, the pools float32 or float16
    (read as stored, computed in float32); everything contiguous, on the CPU.
    """
    mod = _EXTENSION.require()
    b, heads, dim = q.shape
    n, block, kv_heads, kdim = k_pool.shape
    if kdim != dim or v_pool.shape != k_pool.shape:
        raise ValueError(f"pool shapes {tuple(k_pool.shape)}/{tuple(v_pool.shape)} vs q {dim}")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} kv heads")
    if q.dtype != torch.float32 or not q.is_contiguous() or q.device.type != "cpu":
        raise ValueError("q must be a contiguous float32 CPU tensor")
    check_pools(k_pool, v_pool)
    if block_tables.dtype != torch.int64 or block_tables.dim() != 2 or block_tables.shape[0] != b:
        raise ValueError("block_tables must be int64 [B, max_blocks]")
    if context_lens.dtype != torch.int64 or context_lens.shape != (b,):
        raise ValueError("context_lens must be int64 [B]")
    block_tables = block_tables.contiguous()
    context_lens = context_lens.contiguous()
    if not ranges_checked:
        check_decode_ranges(block_tables, context_lens, n, block)
    out = torch.empty_like(q)
    mod.paged_decode_attention(out, q, k_pool, v_pool, block_tables, context_lens, scale)
    return out


def check_pools(k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
    """Both pools contiguous CPU tensors of one dtype the kernels read (``POOL_DTYPES``)."""
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool)):
        if t.dtype not in POOL_DTYPES or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name} must be a contiguous float32 or float16 CPU tensor")
    if v_pool.dtype != k_pool.dtype:
        raise ValueError(f"k_pool is {k_pool.dtype}, v_pool {v_pool.dtype}")


def check_decode_ranges(
    block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    """Every row's context fits its table and every table entry names a pool block."""
    if context_lens.numel() and (
        int(context_lens.min()) < 1
        or int(context_lens.max()) > block_tables.shape[1] * block_size
        or int(block_tables.min()) < 0
        or int(block_tables.max()) >= num_blocks
    ):
        raise ValueError("context_lens or block_tables out of range for the pool")

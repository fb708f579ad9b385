"""Attention over the paged KV pool, from the engine's batch types (any device).

Two shapes of work per layer:
- prefill segments: a chunk of prompt queries, causal among themselves, on top of
  ``context_len`` earlier tokens already in the pool;
- a decode batch: one query per sequence, over variable-length contexts.

GQA is computed without materialising repeated K/V heads: queries are viewed as
``[kv_heads, group, ...]`` and multiplied against each KV head once. Decode runs a
kernel where one applies (the C++ CPU kernel here; the Triton kernel on a GPU, chosen in
``engine/model.py``), else the torch reference; the references live with the kernels
(``kernels/reference.py``), and this module adapts a ``DecodeBatch`` to them.

The pool may hold a narrower dtype than the queries (a float16 KV cache under float32
compute): attention then reads every key and value as stored, widened to the queries'
dtype, a prefill chunk's own fresh keys included. So a token's attention sees the same
numbers whether its context came from this chunk, an earlier chunk, the prefix cache or
another worker's transfer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.forward_batch import DecodeBatch, PrefillSegment
from kernels.paged_attention import POOL_DTYPES, cpu_kernel_available, decode_attention_cpu
from kernels.reference import Workspace, decode_attention_reference


def gather_context(pool: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence as ``[length, kv_heads, head_dim]``."""
    blocks = pool.index_select(0, block_table)
    return blocks.reshape(-1, pool.shape[2], pool.shape[3])[:length]


def as_stored(t: torch.Tensor, pool_dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a pool of ``pool_dtype`` holds it, back in ``t``'s dtype (itself when equal)."""
    return t if t.dtype == pool_dtype else t.to(pool_dtype).to(t.dtype)


def prefill_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    seg: PrefillSegment,
    scale: float,
) -> torch.Tensor:
    """Causal attention for one prefill chunk; returns ``[length, heads, head_dim]``.

    ``q``/``k_new``/``v_new`` are the chunk's own rows. With no earlier context the fresh
    K/V are used directly; otherwise the whole context is read back from the pool (the
    chunk's own K/V were written there before this call).
    """
    n = seg.length
    if seg.context_len == 0:
        keys, values = as_stored(k_new, k_pool.dtype), as_stored(v_new, v_pool.dtype)
        mask = None
        causal = True
    else:
        total = seg.context_len + n
        keys = gather_context(k_pool, seg.block_table, total).to(q.dtype)
        values = gather_context(v_pool, seg.block_table, total).to(q.dtype)
        # query i (absolute position context_len + i) sees keys 0..context_len + i
        qpos = torch.arange(seg.context_len, total, device=q.device).unsqueeze(1)
        kpos = torch.arange(total, device=q.device).unsqueeze(0)
        mask = kpos <= qpos
        causal = False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    batch: DecodeBatch,
    scale: float,
    workspace: Workspace | None = None,
    *,
    kernel: bool = True,
    ranges_checked: bool = False,
) -> torch.Tensor:
    """Decode attention: the CPU kernel where it applies (and ``kernel``), else the torch
    reference. ``ranges_checked``: see ``decode_attention_cpu``."""
    if (
        kernel
        and q.dtype == torch.float32
        and k_pool.dtype in POOL_DTYPES
        and q.device.type == "cpu"
        and cpu_kernel_available()
    ):
        return decode_attention_cpu(
            q.contiguous(), k_pool, v_pool, batch.block_tables, batch.context_lens, scale,
            ranges_checked=ranges_checked,
        )  # fmt: skip
    return decode_attention_reference(
        q, k_pool, v_pool, batch.block_tables, batch.context_lens, scale, workspace,
        max_context_len=batch.max_context_len,
    )  # fmt: skip

"""Paged decode attention in Triton: one query per sequence over its paged context.

Contract (the same as ``kernels.reference.decode_attention_reference``, the reference):
``q`` ``[B, heads, D]``; ``k_pool``/``v_pool`` one layer's ``[num_blocks, block_size,
kv_heads, D]``; ``block_tables`` ``[B, max_blocks]`` and ``context_lens`` ``[B]``
(int32 or int64) where row ``b``'s first ``context_lens[b]`` tokens live in the blocks its
table names, in order. Query head ``h`` reads KV head ``h // (heads // kv_heads)``.
Returns ``[B, heads, D]`` in ``q``'s dtype; scores, softmax and the sum run in float32.

One program per (sequence, KV head) loads that KV head's rows once for its whole query
group, and walks the sequence's blocks with an online softmax, so nothing the length of the
context is materialised.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import decode_attention_reference
from kernels.triton.checks import (
    INDEX_DTYPES,
    check_dim,
    check_dtype,
    check_index_range,
    check_pools,
    check_rows_contiguous,
    check_same_device,
    check_shape,
)


@triton.jit
def _paged_decode_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_pool_block,
    stride_pool_token,
    stride_pool_head,
    stride_table,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context = tl.load(lens_ptr + seq).to(tl.int32)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    t = tl.arange(0, BLOCK_SIZE)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask)
    q = q.to(tl.float32) * scale

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for i in range(0, tl.cdiv(context, BLOCK_SIZE)):
        block = tl.load(tables_ptr + seq * stride_table + i).to(tl.int64)
        t_mask = i * BLOCK_SIZE + t < context
        rows = block * stride_pool_block + t[:, None] * stride_pool_token
        offs = rows + kv_head * stride_pool_head + d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        # Broadcast-and-sum rather than tl.dot: a query group (1..8) and a block (8..) can be
        # below tl.dot's 16-row minimum, and decode is bound by reading K/V, not by FLOPs.
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # every row's first block holds a token (context >= 1), so m_new is finite here
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        denom = denom * alpha + tl.sum(p, axis=1)
        m = m_new
    out = acc / denom[:, None]
    o_offs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    ranges_checked: bool = False,
) -> torch.Tensor:
    """Checked launcher (contract in the module docstring); ``ValueError`` on bad input.

    ``ranges_checked``: the caller checked the table and length ranges on the host (the
    engine does, once per step), so the two reductions that sync with the device are
    skipped; shapes, dtypes, strides and devices are still checked.

    Strides: ``q`` and the pools need a packed last dim (the pools their last three dims,
    equal strides for K and V); outer dims may be strided views. Every ``context_lens``
    entry is in ``[1, max_blocks * block_size]`` and every table entry names a pool block
    (padding too: pad with a real id such as 0).
    """
    check_dim("q", q, 3, "[B, heads, head_dim]")
    check_pools(k_pool, v_pool)
    b, heads, dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_pool.shape
    check_shape("k_pool", k_pool, (num_blocks, block_size, kv_heads, dim))
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} kv heads")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    check_dtype("q", q, (k_pool.dtype,))
    check_dim("block_tables", block_tables, 2, "[B, max_blocks]")
    check_shape("block_tables", block_tables, (b, block_tables.shape[1]))
    check_shape("context_lens", context_lens, (b,))
    check_dtype("block_tables", block_tables, INDEX_DTYPES)
    check_dtype("context_lens", context_lens, INDEX_DTYPES)
    check_same_device(
        q=q, k_pool=k_pool, v_pool=v_pool, block_tables=block_tables, context_lens=context_lens
    )
    check_rows_contiguous("q", q, 1)
    block_tables = block_tables.contiguous()
    if not ranges_checked:
        max_len = block_tables.shape[1] * block_size
        check_index_range("context_lens", context_lens, 1, max_len + 1)
        check_index_range("block_tables", block_tables, 0, num_blocks)
    out = torch.empty((b, heads, dim), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    group = heads // kv_heads
    _paged_decode_kernel[(b, kv_heads)](
        out, q, k_pool, v_pool, block_tables, context_lens, float(scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_SIZE=block_size,
        HEAD_DIM=dim, DIM_PAD=triton.next_power_of_2(dim),
    )  # fmt: skip
    return out


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``decode_attention_reference`` on the CPU in float32, so a bf16 kernel is compared
    with exact math rather than with another rounding; the result comes back in ``q``'s
    dtype and device."""
    k, v = k_pool.cpu().float(), v_pool.cpu().float()
    tables, lens = block_tables.cpu().long(), context_lens.cpu().long()
    out = decode_attention_reference(q.cpu().float(), k, v, tables, lens, scale)
    return out.to(device=q.device, dtype=q.dtype)

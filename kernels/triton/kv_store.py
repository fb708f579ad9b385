"""Store a step's new keys and values into their slots of one layer's paged pool, in Triton.

Contract (the same as ``kernels.reference.write_kv``, the reference): ``k``/``v``
``[T, kv_heads, D]``; token ``i`` goes to ``k_pool[slot_blocks[i], slot_offsets[i]]`` (and
``v_pool`` likewise), pools ``[num_blocks, block_size, kv_heads, D]`` of the same dtype.
One program per token copies its ``kv_heads x D`` rows of keys and of values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import write_kv
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
def _kv_store_kernel(
    k_ptr,
    v_ptr,
    k_pool_ptr,
    v_pool_ptr,
    blocks_ptr,
    offsets_ptr,
    stride_k_token,
    stride_v_token,
    stride_pool_block,
    stride_pool_token,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    block = tl.load(blocks_ptr + token).to(tl.int64)
    offset = tl.load(offsets_ptr + token).to(tl.int64)
    slot = block * stride_pool_block + offset * stride_pool_token
    # a token's kv_heads x head_dim values are one packed row on both sides (checked)
    e = tl.arange(0, ROW_PAD)
    mask = e < ROW
    k = tl.load(k_ptr + token * stride_k_token + e, mask=mask)
    v = tl.load(v_ptr + token * stride_v_token + e, mask=mask)
    tl.store(k_pool_ptr + slot + e, k, mask=mask)
    tl.store(v_pool_ptr + slot + e, v, mask=mask)


def store_kv(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    *,
    ranges_checked: bool = False,
) -> None:
    """Checked launcher (contract in the module docstring); ``ValueError`` on bad input.

    ``ranges_checked``: the caller checked that the slots are in range and distinct (the
    engine's slots come from its block manager and are checked on the host once per
    step), so the reductions that sync with the device are skipped.

    ``k``/``v`` may be token-strided views (a slice of a fused QKV output) but each token's
    ``[kv_heads, D]`` must be packed, and so must a pool's last three dims. Slots must be in
    range and distinct: two tokens in one slot would race.
    """
    check_pools(k_pool, v_pool)
    num_blocks, block_size, kv_heads, dim = k_pool.shape
    check_dim("k", k, 3, "[T, kv_heads, head_dim]")
    tokens = k.shape[0]
    check_shape("k", k, (tokens, kv_heads, dim))
    check_shape("v", v, (tokens, kv_heads, dim))
    check_shape("slot_blocks", slot_blocks, (tokens,))
    check_shape("slot_offsets", slot_offsets, (tokens,))
    check_dtype("k", k, (k_pool.dtype,))
    check_dtype("v", v, (k_pool.dtype,))
    check_dtype("slot_blocks", slot_blocks, INDEX_DTYPES)
    check_dtype("slot_offsets", slot_offsets, INDEX_DTYPES)
    check_same_device(
        k_pool=k_pool, v_pool=v_pool, k=k, v=v, slot_blocks=slot_blocks, slot_offsets=slot_offsets
    )
    check_rows_contiguous("k", k, 2)
    check_rows_contiguous("v", v, 2)
    if tokens == 0:
        return
    if not ranges_checked:
        check_index_range("slot_blocks", slot_blocks, 0, num_blocks)
        check_index_range("slot_offsets", slot_offsets, 0, block_size)
        slots = slot_blocks.long() * block_size + slot_offsets.long()
        if torch.unique(slots).numel() != tokens:
            raise ValueError("two tokens share a slot (slot_blocks, slot_offsets)")
    row = kv_heads * dim
    _kv_store_kernel[(tokens,)](
        k, v, k_pool, v_pool, slot_blocks.contiguous(), slot_offsets.contiguous(),
        k.stride(0), v.stride(0), k_pool.stride(0), k_pool.stride(1),
        ROW=row, ROW_PAD=triton.next_power_of_2(row),
    )  # fmt: skip


def store_kv_reference(
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    """``write_kv`` with the slot ids widened to int64."""
    write_kv(k_pool, v_pool, k, v, slot_blocks.long(), slot_offsets.long())

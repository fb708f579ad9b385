"""One layer's KV blocks of a request packed into a contiguous buffer, and back, in Triton.

``gather_kv_blocks(k_pool, v_pool, block_ids)`` returns ``[2, n, block_size, kv_heads, D]``:
the keys of ``block_ids`` in order, then their values. That is byte for byte what the
transfer layer moves for one layer (``transfer.plan.BlockPlan.ranges``: every run's keys,
then every run's values, each block ``block_size x kv_heads x D`` packed as in the pool), so
a staging buffer filled here can be sent as one range. ``scatter_kv_blocks`` is the inverse:
it writes such a buffer into the (distinct) destination ``block_ids``.

One program per (block, key or value, chunk of the block) copies ``CHUNK`` elements: a
block is one packed run in the pool, so the copy is a flat memcpy per block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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

_CHUNK = 1024


@triton.jit
def _copy_blocks_kernel(
    src_k_ptr,
    src_v_ptr,
    dst_k_ptr,
    dst_v_ptr,
    ids_ptr,
    stride_src_block,
    stride_dst_block,
    BLOCK_ELEMS: tl.constexpr,
    CHUNK: tl.constexpr,
    GATHER: tl.constexpr,
):
    i = tl.program_id(0)
    is_value = tl.program_id(1)
    e = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    mask = e < BLOCK_ELEMS
    pool_block = tl.load(ids_ptr + i).to(tl.int64)
    # gather: pool block ids[i] -> buffer row i; scatter: buffer row i -> pool block ids[i]
    if GATHER:
        src = pool_block * stride_src_block + e
        dst = i.to(tl.int64) * stride_dst_block + e
    else:
        src = i.to(tl.int64) * stride_src_block + e
        dst = pool_block * stride_dst_block + e
    if is_value == 0:
        tl.store(dst_k_ptr + dst, tl.load(src_k_ptr + src, mask=mask), mask=mask)
    else:
        tl.store(dst_v_ptr + dst, tl.load(src_v_ptr + src, mask=mask), mask=mask)


def _check_inputs(k_pool: torch.Tensor, v_pool: torch.Tensor, block_ids: torch.Tensor) -> None:
    check_pools(k_pool, v_pool)
    check_dim("block_ids", block_ids, 1, "[n]")
    check_dtype("block_ids", block_ids, INDEX_DTYPES)


def _launch(
    src_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    block_ids: torch.Tensor,
    *,
    gather: bool,
) -> None:
    n = block_ids.numel()
    if n == 0:
        return
    elems = src_k[0].numel()
    grid = (n, 2, triton.cdiv(elems, _CHUNK))
    _copy_blocks_kernel[grid](
        src_k, src_v, dst_k, dst_v, block_ids.contiguous(), src_k.stride(0), dst_k.stride(0),
        BLOCK_ELEMS=elems, CHUNK=min(_CHUNK, triton.next_power_of_2(elems)), GATHER=gather,
    )  # fmt: skip


def gather_kv_blocks(
    k_pool: torch.Tensor, v_pool: torch.Tensor, block_ids: torch.Tensor
) -> torch.Tensor:
    """Checked launcher: ``[2, n, block_size, kv_heads, D]`` copy of ``block_ids``' keys then
    values (ids may repeat); ``ValueError`` on bad input."""
    _check_inputs(k_pool, v_pool, block_ids)
    check_same_device(k_pool=k_pool, v_pool=v_pool, block_ids=block_ids)
    check_index_range("block_ids", block_ids, 0, k_pool.shape[0])
    out = torch.empty((2, block_ids.numel(), *k_pool.shape[1:]), dtype=k_pool.dtype,
                      device=k_pool.device)  # fmt: skip
    _launch(k_pool, v_pool, out[0], out[1], block_ids, gather=True)
    return out


def scatter_kv_blocks(
    packed: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_ids: torch.Tensor
) -> None:
    """Checked launcher: write ``packed`` (``[2, n, block_size, kv_heads, D]``, as
    ``gather_kv_blocks`` makes it) into pool blocks ``block_ids``, which must be distinct
    (two rows into one block would race); ``ValueError`` on bad input."""
    _check_inputs(k_pool, v_pool, block_ids)
    check_shape("packed", packed, (2, block_ids.numel(), *k_pool.shape[1:]))
    check_dtype("packed", packed, (k_pool.dtype,))
    check_same_device(packed=packed, k_pool=k_pool, v_pool=v_pool, block_ids=block_ids)
    check_rows_contiguous("packed", packed, 3)
    check_index_range("block_ids", block_ids, 0, k_pool.shape[0])
    if torch.unique(block_ids).numel() != block_ids.numel():
        raise ValueError("block_ids repeat a destination block")
    _launch(packed[0], packed[1], k_pool, v_pool, block_ids, gather=False)


def gather_kv_blocks_reference(
    k_pool: torch.Tensor, v_pool: torch.Tensor, block_ids: torch.Tensor
) -> torch.Tensor:
    ids = block_ids.long()
    return torch.stack((k_pool.index_select(0, ids), v_pool.index_select(0, ids)))


def scatter_kv_blocks_reference(
    packed: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_ids: torch.Tensor
) -> None:
    ids = block_ids.long()
    k_pool[ids] = packed[0]
    v_pool[ids] = packed[1]

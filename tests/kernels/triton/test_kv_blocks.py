"""The Triton per-layer KV gather/scatter equals index_select/index_put (under the
interpreter on CPU), packs exactly the bytes ``transfer.plan`` moves for a layer, and its
launchers refuse bad input with a message naming it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is a test dependency: pip install -e '.[test]'")

from engine.kv_cache import KVCache, KVCacheSpec
from kernels.triton.kv_blocks import (
    gather_kv_blocks,
    gather_kv_blocks_reference,
    scatter_kv_blocks,
    scatter_kv_blocks_reference,
)
from tests.kernels.triton.cases import on, pools
from transfer.handle import KVLayout
from transfer.plan import plan_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("block_size", "kv_heads", "dim"), [(8, 3, 24), (16, 2, 64), (32, 1, 8)])
def test_round_trip_matches_reference(device, dtype, block_size, kv_heads, dim) -> None:
    g = torch.Generator().manual_seed(block_size)
    k_pool, v_pool = pools(g, 12, block_size, kv_heads, dim, dtype)
    src_ids = torch.tensor([7, 2, 3, 4, 11], dtype=torch.int32)  # a run inside, shuffled
    packed = gather_kv_blocks(k_pool.to(device), v_pool.to(device), src_ids.to(device))
    assert torch.equal(packed.cpu(), gather_kv_blocks_reference(k_pool, v_pool, src_ids))

    dst_k, dst_v = pools(g, 9, block_size, kv_heads, dim, dtype)
    dst_ids = torch.tensor([0, 8, 5, 6, 1], dtype=torch.int64)
    ref_k, ref_v = dst_k.clone(), dst_v.clone()
    scatter_kv_blocks_reference(packed.cpu(), ref_k, ref_v, dst_ids)
    out_k, out_v = dst_k.clone().to(device), dst_v.clone().to(device)
    scatter_kv_blocks(packed, out_k, out_v, dst_ids.to(device))
    assert torch.equal(out_k.cpu(), ref_k) and torch.equal(out_v.cpu(), ref_v)
    # the untouched blocks kept their bytes
    assert torch.equal(out_k.cpu()[[2, 3, 4, 7]], dst_k[[2, 3, 4, 7]])


def test_packs_the_bytes_transfer_moves_for_a_layer(device) -> None:
    spec = KVCacheSpec(
        num_layers=3, num_blocks=10, block_size=8, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16
    )
    cache = KVCache(spec)
    cache.pool.copy_(torch.randn(spec.shape, generator=torch.Generator().manual_seed(3)))
    layout = KVLayout.from_spec(spec)
    ids = [6, 7, 8, 1, 4]
    layer = 1
    flat = cache.as_bytes()
    moved = torch.cat(
        [flat[s : s + n] for s, _, n in plan_blocks(layout, layout, ids, ids).ranges(layer)]
    )
    pool = cache.pool.to(device)
    packed = gather_kv_blocks(pool[layer, 0], pool[layer, 1], torch.tensor(ids, device=device))
    assert torch.equal(packed.cpu().reshape(-1).view(torch.uint8), moved)


def test_no_blocks(device) -> None:
    g = torch.Generator().manual_seed(0)
    k_pool, v_pool = (t.to(device) for t in pools(g, 2, 8, 1, 8, torch.float32))
    ids = torch.empty(0, dtype=torch.int32, device=device)
    packed = gather_kv_blocks(k_pool, v_pool, ids)
    assert packed.shape == (2, 0, 8, 1, 8)
    scatter_kv_blocks(packed, k_pool, v_pool, ids)


def _pools():
    return pools(torch.Generator().manual_seed(1), 4, 8, 2, 16, torch.float32)


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        (torch.tensor([0, 4]), r"block_ids out of range: entries in \[0, 4\], allowed \[0, 4\)"),
        (torch.tensor([-1]), "block_ids out of range"),
        (torch.tensor([[0, 1]]), r"block_ids must be \[n\]"),
        (torch.tensor([0.0]), "block_ids must be one of int32, int64"),
    ],
)
def test_gather_refuses(device, ids, match) -> None:
    k_pool, v_pool = _pools()
    args = {"k_pool": k_pool, "v_pool": v_pool, "block_ids": ids}
    with pytest.raises(ValueError, match=match):
        gather_kv_blocks(**on(device, args))


def test_gather_refuses_pools(device) -> None:
    k_pool, v_pool = (t.to(device) for t in _pools())
    ids = torch.tensor([1], device=device)
    with pytest.raises(ValueError, match="v_pool must be one of float32, got bfloat16"):
        gather_kv_blocks(k_pool, v_pool.bfloat16(), ids)
    with pytest.raises(ValueError, match=r"v_pool must have shape \(4, 8, 2, 16\)"):
        gather_kv_blocks(k_pool, v_pool[:3], ids)
    with pytest.raises(ValueError, match="k_pool's last 3 dims must be contiguous"):
        gather_kv_blocks(k_pool[:, :, :, ::2], v_pool[:, :, :, ::2], ids)
    with pytest.raises(ValueError, match="inputs must share one device"):
        gather_kv_blocks(k_pool, v_pool, ids.to("meta"))


@pytest.mark.parametrize(
    ("packed", "ids", "match"),
    [
        (torch.zeros(2, 2, 8, 2, 16), torch.tensor([1, 1]), "block_ids repeat a destination"),
        (torch.zeros(2, 2, 8, 2, 16), torch.tensor([1, 4]), "block_ids out of range"),
        (torch.zeros(2, 3, 8, 2, 16), torch.tensor([1, 2]), r"packed must have shape \(2, 2,"),
        (torch.zeros(2, 2, 8, 2, 16).double(), torch.tensor([1, 2]), "packed must be one of"),
        (
            torch.zeros(2, 2, 8, 16, 2).transpose(3, 4),
            torch.tensor([1, 2]),
            "packed's last 3 dims must be contiguous",
        ),
    ],
)
def test_scatter_refuses(device, packed, ids, match) -> None:
    k_pool, v_pool = _pools()
    args = {"packed": packed, "k_pool": k_pool, "v_pool": v_pool, "block_ids": ids}
    with pytest.raises(ValueError, match=match):
        scatter_kv_blocks(**on(device, args))

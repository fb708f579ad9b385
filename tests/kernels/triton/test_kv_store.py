"""The Triton KV store writes exactly what the engine's ``write_kv`` writes (under the
interpreter on CPU), and its launcher refuses bad input with a message naming it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is a test dependency: pip install -e '.[test]'")

from kernels.triton.kv_store import store_kv, store_kv_reference
from tests.kernels.triton.cases import on, pools


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("block_size", "kv_heads", "dim"), [(8, 1, 16), (16, 3, 24), (32, 8, 8)])
def test_matches_write_kv(device, dtype, block_size, kv_heads, dim) -> None:
    g = torch.Generator().manual_seed(block_size)
    k_pool, v_pool = pools(g, 7, block_size, kv_heads, dim, dtype)
    tokens = 2 * block_size + 3
    # distinct slots scattered over the pool, as a prefill chunk plus decode tokens would be
    slots = torch.randperm(7 * block_size, generator=g)[:tokens]
    blocks, offsets = (slots // block_size).int(), (slots % block_size).int()
    # k/v as token-strided slices of one fused tensor, the way a KV projection yields them
    fused = torch.randn(tokens, 2, kv_heads, dim, generator=g).to(dtype)
    k, v = fused[:, 0], fused[:, 1]
    ref_k, ref_v = k_pool.clone(), v_pool.clone()
    store_kv_reference(ref_k, ref_v, k, v, blocks, offsets)
    out_k, out_v = k_pool.clone().to(device), v_pool.clone().to(device)
    store_kv(out_k, out_v, k.to(device), v.to(device), blocks.to(device), offsets.long().to(device))
    assert torch.equal(out_k.cpu(), ref_k) and torch.equal(out_v.cpu(), ref_v)
    assert not torch.equal(ref_k, k_pool)  # the reference did write something


def test_no_tokens_is_a_no_op(device) -> None:
    g = torch.Generator().manual_seed(0)
    k_pool, v_pool = (t.to(device) for t in pools(g, 2, 8, 1, 8, torch.float32))
    before = k_pool.clone()
    empty = torch.empty(0, 1, 8, device=device)
    ids = torch.empty(0, dtype=torch.int32, device=device)
    store_kv(k_pool, v_pool, empty, empty, ids, ids)
    assert torch.equal(k_pool, before)


def _good():
    g = torch.Generator().manual_seed(1)
    k_pool, v_pool = pools(g, 4, 8, 2, 16, torch.float32)
    return {
        "k_pool": k_pool,
        "v_pool": v_pool,
        "k": torch.randn(3, 2, 16, generator=g),
        "v": torch.randn(3, 2, 16, generator=g),
        "slot_blocks": torch.tensor([3, 0, 3], dtype=torch.int32),
        "slot_offsets": torch.tensor([0, 7, 1], dtype=torch.int32),
    }


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda a: {**a, "k": a["k"][:, :1]}, r"k must have shape \(3, 2, 16\)"),
        (lambda a: {**a, "v": a["v"][:2]}, r"v must have shape \(3, 2, 16\)"),
        (lambda a: {**a, "k": a["k"][0]}, r"k must be \[T, kv_heads, head_dim\]"),
        (lambda a: {**a, "slot_offsets": a["slot_offsets"][:2]}, "slot_offsets must have shape"),
        (lambda a: {**a, "k": a["k"].bfloat16()}, "k must be one of float32, got bfloat16"),
        (lambda a: {**a, "v_pool": a["v_pool"].half()}, "v_pool must be one of float32"),
        (lambda a: {**a, "k_pool": a["k_pool"].int()}, "k_pool must be one of float32, float16"),
        (lambda a: {**a, "slot_blocks": a["slot_blocks"].float()}, "slot_blocks must be one of"),
        (
            lambda a: {**a, "k": a["k"].transpose(1, 2).contiguous().transpose(1, 2)},
            "k's last 2 dims must be contiguous",
        ),
        (
            lambda a: {**a, "v_pool": a["v_pool"].transpose(1, 2).contiguous().transpose(1, 2)},
            "k_pool and v_pool strides differ",
        ),
        (
            lambda a: {**a, "slot_blocks": torch.tensor([3, 4, 0], dtype=torch.int32)},
            r"slot_blocks out of range: entries in \[0, 4\], allowed \[0, 4\)",
        ),
        (
            lambda a: {**a, "slot_offsets": torch.tensor([0, 8, 1], dtype=torch.int32)},
            r"slot_offsets out of range: entries in \[0, 8\], allowed \[0, 8\)",
        ),
        (
            lambda a: {**a, "slot_offsets": torch.tensor([0, 7, 0], dtype=torch.int32)},
            "two tokens share a slot",
        ),
        (lambda a: {**a, "k": a["k"].to("meta")}, "inputs must share one device"),
    ],
)
def test_launcher_refuses(device, mutate, match) -> None:
    with pytest.raises(ValueError, match=match):
        store_kv(**on(device, mutate(_good())))

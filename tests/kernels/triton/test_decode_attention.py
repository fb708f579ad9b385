"""The Triton paged decode attention kernel equals the engine's torch reference (under the
interpreter on CPU), and its launcher refuses bad input with a message naming it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is a test dependency: pip install -e '.[test]'")

from engine.kv_cache import KVCache, KVCacheSpec
from kernels.triton.decode_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
)
from tests.kernels.triton.cases import TOLERANCE, blocks_needed, on, pools, shuffled_tables


def _run(device, dtype, block_size, kv_heads, ratio, dim, lens, index_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = blocks_needed(lens, block_size) + 3
    k_pool, v_pool = pools(g, num_blocks, block_size, kv_heads, dim, dtype)
    table = shuffled_tables(g, lens, block_size, num_blocks, index_dtype)
    q = torch.randn(len(lens), kv_heads * ratio, dim, generator=g).to(dtype)
    ctx = torch.tensor(lens, dtype=index_dtype)
    args = [t.to(device) for t in (q, k_pool, v_pool, table, ctx)]
    out = paged_decode_attention(*args, dim**-0.5)
    ref = paged_decode_attention_reference(q, k_pool, v_pool, table, ctx, dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.cpu(), ref, **TOLERANCE[dtype])


# Every dtype, block size and GQA ratio appears in the default run; the rest of the grid
# (interpreted on the CPU, seconds a case) runs under -m slow and on a GPU.
_DEFAULT_CASES = {(torch.float32, 16, 1), (torch.bfloat16, 8, 3), (torch.float32, 32, 8)}
_GRID = [
    pytest.param(
        dtype, block_size, ratio,
        id=f"{ratio}-{block_size}-{'fp32' if dtype is torch.float32 else 'bf16'}",
        marks=() if (dtype, block_size, ratio) in _DEFAULT_CASES else pytest.mark.slow,
    )
    for ratio in (1, 3, 8)
    for block_size in (8, 16, 32)
    for dtype in (torch.float32, torch.bfloat16)
]  # fmt: skip


@pytest.mark.parametrize(("dtype", "block_size", "ratio"), _GRID)
def test_matches_reference(device, dtype, block_size, ratio) -> None:
    # ragged: one token, exactly one block, one past a block, several blocks and a ragged tail
    lens = [1, block_size, block_size + 1, 3 * block_size - 5]
    _run(device, dtype, block_size, 2, ratio, 16, lens, torch.int32, seed=block_size + ratio)


@pytest.mark.parametrize(
    ("kv_heads", "ratio", "dim", "lens"),
    [
        (1, 8, 24, [7, 40]),  # head dim not a power of two: masked lanes
        (3, 3, 64, [33]),  # the default model's head dim, MQA-free GQA 3
    ],
)
def test_other_shapes_with_int64_tables(device, kv_heads, ratio, dim, lens) -> None:
    _run(device, torch.float32, 16, kv_heads, ratio, dim, lens, torch.int64)


def test_engine_layer_views_and_strided_queries(device) -> None:
    # The engine hands a layer's views of one pool (offset into the storage) and its queries
    # may be a slice of a fused projection (heads strided wider than head_dim).
    spec = KVCacheSpec(
        num_layers=2, num_blocks=9, block_size=8, num_kv_heads=2, head_dim=16, dtype=torch.float32
    )
    cache = KVCache(spec)
    g = torch.Generator().manual_seed(5)
    cache.pool.copy_(torch.randn(spec.shape, generator=g))
    fused = torch.randn(3, 6, 48, generator=g)
    q = fused[:, :, 16:32]
    table = torch.tensor([[4, 1, 7], [0, 0, 0], [8, 2, 0]], dtype=torch.int32)
    ctx = torch.tensor([24, 8, 9], dtype=torch.int32)
    k, v = cache.keys(1), cache.values(1)
    out = paged_decode_attention(
        q.to(device), k.to(device), v.to(device), table.to(device), ctx.to(device), 0.25
    )
    ref = paged_decode_attention_reference(q, k, v, table, ctx, 0.25)
    torch.testing.assert_close(out.cpu(), ref, **TOLERANCE[torch.float32])


def _good():
    g = torch.Generator().manual_seed(1)
    k_pool, v_pool = pools(g, 6, 8, 2, 16, torch.float32)
    return {
        "q": torch.randn(2, 4, 16, generator=g),
        "k_pool": k_pool,
        "v_pool": v_pool,
        "block_tables": torch.tensor([[1, 3], [5, 0]], dtype=torch.int32),
        "context_lens": torch.tensor([16, 3], dtype=torch.int32),
        "scale": 0.25,
    }


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda a: {**a, "q": a["q"][0]}, r"q must be \[B, heads, head_dim\]"),
        (lambda a: {**a, "k_pool": a["k_pool"][0]}, r"k_pool must be \[num_blocks"),
        (lambda a: {**a, "v_pool": a["v_pool"][:, :, :1]}, r"v_pool must have shape"),
        (lambda a: {**a, "q": a["q"][:, :, :8]}, r"k_pool must have shape"),
        (lambda a: {**a, "q": a["q"][:, :3]}, "3 query heads do not group over 2"),
        (lambda a: {**a, "q": a["q"].double()}, "q must be one of float32, got float64"),
        (
            lambda a: {**a, "k_pool": a["k_pool"].half(), "v_pool": a["v_pool"].half()},
            "q must be one of float16, got float32",
        ),
        (lambda a: {**a, "v_pool": a["v_pool"].bfloat16()}, "v_pool must be one of float32"),
        (lambda a: {**a, "block_tables": a["block_tables"].float()}, "block_tables must be one"),
        (
            lambda a: {**a, "context_lens": a["context_lens"][:1]},
            r"context_lens must have shape \(2,\)",
        ),
        (lambda a: {**a, "block_tables": a["block_tables"][0]}, r"block_tables must be \[B"),
        (
            lambda a: {**a, "q": a["q"].transpose(1, 2).contiguous().transpose(1, 2)},
            "q's last 1 dims must be contiguous",
        ),
        (
            lambda a: {**a, "k_pool": a["k_pool"].transpose(1, 2).contiguous().transpose(1, 2)},
            "k_pool's last 3 dims must be contiguous",
        ),
        (
            lambda a: {**a, "context_lens": torch.tensor([17, 3], dtype=torch.int32)},
            r"context_lens out of range: entries in \[3, 17\], allowed \[1, 17\)",
        ),
        (
            lambda a: {**a, "context_lens": torch.tensor([0, 3], dtype=torch.int32)},
            "context_lens out of range",
        ),
        (
            lambda a: {**a, "block_tables": torch.tensor([[1, 6], [5, 0]], dtype=torch.int32)},
            r"block_tables out of range: entries in \[0, 6\], allowed \[0, 6\)",
        ),
        (
            lambda a: {**a, "block_tables": torch.tensor([[1, -1], [5, 0]], dtype=torch.int32)},
            "block_tables out of range",
        ),
        (lambda a: {**a, "q": a["q"].to("meta")}, "inputs must share one device: q on meta"),
    ],
)
def test_launcher_refuses(device, mutate, match) -> None:
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(**on(device, mutate(_good())))


def test_block_size_must_be_a_power_of_two() -> None:
    args = _good()
    g = torch.Generator().manual_seed(2)
    args["k_pool"], args["v_pool"] = pools(g, 6, 6, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="block_size must be a power of two, got 6"):
        paged_decode_attention(**args)


def test_cpu_tensors_need_the_interpreter(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CPU tensors need TRITON_INTERPRET=1"):
        paged_decode_attention(**_good())

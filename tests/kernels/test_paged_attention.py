"""The CPU paged decode attention kernel equals the torch reference, and checks its inputs."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import cpu_kernel_available, decode_attention_cpu
from kernels.reference import decode_attention_reference


def _case(seed: int, b: int, heads: int, kv_heads: int, dim: int, block: int, lens: list[int]):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block) for n in lens)
    num_blocks = b * max_blocks + 5
    k_pool = torch.randn(num_blocks, block, kv_heads, dim, generator=g)
    v_pool = torch.randn(num_blocks, block, kv_heads, dim, generator=g)
    # scattered, non-overlapping blocks per sequence; unused table slots padded with 0
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(b, max_blocks, dtype=torch.int64)
    used = 0
    for r, n in enumerate(lens):
        nb = -(-n // block)
        table[r, :nb] = perm[used : used + nb]
        used += nb
    q = torch.randn(b, heads, dim, generator=g)
    ctx = torch.tensor(lens, dtype=torch.int64)
    return q, k_pool, v_pool, table, ctx


def test_kernel_compiles_here() -> None:
    # The machines pdserve is tested on have a C++ compiler; a silent fallback would hide
    # a broken build.
    assert cpu_kernel_available()


@pytest.mark.parametrize(
    ("b", "heads", "kv_heads", "dim", "block", "lens"),
    [
        (1, 9, 3, 64, 16, [1]),
        (4, 9, 3, 64, 16, [1, 16, 17, 300]),
        (3, 8, 8, 32, 8, [5, 64, 9]),  # no GQA
        (2, 8, 1, 16, 4, [3, 40]),  # MQA, small blocks
        (5, 4, 2, 12, 16, [7, 1, 33, 16, 2]),  # head dim not a multiple of 8: scalar path
        (3, 6, 2, 24, 16, [8, 40, 17]),  # 3 vectors a row
        (2, 4, 2, 128, 16, [9, 70]),  # rows wider than the register tile
        (2, 8, 2, 40, 16, [5, 33]),  # 4 query heads a kv head, 5 vectors a row
    ],
)
def test_kernel_matches_reference(b, heads, kv_heads, dim, block, lens) -> None:
    q, k_pool, v_pool, table, ctx = _case(7, b, heads, kv_heads, dim, block, lens)
    scale = dim**-0.5
    ref = decode_attention_reference(q, k_pool, v_pool, table, ctx, scale)
    out = decode_attention_cpu(q, k_pool, v_pool, table, ctx, scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("b", "heads", "kv_heads", "dim", "block", "lens"),
    [
        (4, 9, 3, 64, 16, [1, 16, 17, 300]),  # SmolLM2's heads: the F16C vector paths
        (5, 4, 2, 12, 16, [7, 1, 33, 16, 2]),  # scalar path
        (2, 4, 2, 128, 16, [9, 70]),  # rows wider than the register tile
    ],
)
def test_float16_pool_matches_reference_on_the_widened_values(
    b, heads, kv_heads, dim, block, lens
) -> None:
    # A float16 pool is read as stored and computed in float32: the same result as the
    # float32 kernel on the pool's values widened back to float32.
    q, k_pool, v_pool, table, ctx = _case(11, b, heads, kv_heads, dim, block, lens)
    k16, v16 = k_pool.half(), v_pool.half()
    scale = dim**-0.5
    widened = decode_attention_cpu(q, k16.float(), v16.float(), table, ctx, scale)
    out = decode_attention_cpu(q, k16, v16, table, ctx, scale)
    torch.testing.assert_close(out, widened, rtol=1e-6, atol=1e-6)
    ref = decode_attention_reference(q, k16, v16, table, ctx, scale)
    assert ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_rows_are_batch_invariant() -> None:
    q, k_pool, v_pool, table, ctx = _case(3, 6, 9, 3, 64, 16, [20, 90, 3, 64, 200, 1])
    full = decode_attention_cpu(q, k_pool, v_pool, table, ctx, 0.125)
    for r in range(6):
        one = decode_attention_cpu(
            q[r : r + 1], k_pool, v_pool, table[r : r + 1], ctx[r : r + 1], 0.125
        )
        assert torch.equal(one[0], full[r])


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda a: {**a, "q": a["q"].double()}, "float32"),
        (lambda a: {**a, "q": a["q"].transpose(0, 1).contiguous().transpose(0, 1)}, "contiguous"),
        (lambda a: {**a, "context_lens": a["context_lens"] + 1000}, "out of range"),
        (lambda a: {**a, "context_lens": a["context_lens"] * 0}, "out of range"),
        (lambda a: {**a, "block_tables": a["block_tables"] + 10_000}, "out of range"),
        (lambda a: {**a, "block_tables": a["block_tables"].int()}, "int64"),
        (lambda a: {**a, "v_pool": a["v_pool"][:, :, :1].contiguous()}, "pool shapes"),
        (lambda a: {**a, "k_pool": a["k_pool"].bfloat16()}, "float32 or float16"),
        (lambda a: {**a, "v_pool": a["v_pool"].half()}, "v_pool"),
    ],
)
def test_launcher_rejects_bad_inputs(mutate, match) -> None:
    q, k_pool, v_pool, table, ctx = _case(1, 2, 9, 3, 64, 16, [10, 20])
    args = {"q": q, "k_pool": k_pool, "v_pool": v_pool, "block_tables": table, "context_lens": ctx}
    with pytest.raises(ValueError, match=match):
        decode_attention_cpu(**mutate(args), scale=0.125)

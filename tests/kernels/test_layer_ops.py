"""kernels.layer_ops: the fused per-layer CPU ops against the engine's torch references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.rope import RotaryEmbedding
from kernels import layer_ops
from kernels.reference import write_kv

EPS = 1e-5


def reference_rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def test_builds_here() -> None:
    assert layer_ops.layer_ops_available()


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("width", [64, 576, 100])
def test_rms_norm_and_add_rms_norm(rows: int, width: int) -> None:
    g = torch.Generator().manual_seed(rows * width)
    x, d = torch.randn(rows, width, generator=g) * 3, torch.randn(rows, width, generator=g)
    w = 1 + torch.randn(width, generator=g) * 0.1
    torch.testing.assert_close(layer_ops.rms_norm(x, w, EPS), reference_rms_norm(x, w))
    residual = x.clone()
    out = layer_ops.add_rms_norm(residual, d, w, EPS)
    assert torch.equal(residual, x + d)  # the residual stream is updated in place, exactly
    torch.testing.assert_close(out, reference_rms_norm(x + d, w))


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("inter", [1536, 13])
def test_silu_mul(rows: int, inter: int) -> None:
    gu = torch.randn(rows, 2 * inter) * 6
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamps and zero
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(layer_ops.silu_mul(gu), F.silu(gate) * up)


def _config(heads: int, kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=32, hidden_size=heads * head_dim, intermediate_size=64, num_layers=1,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=EPS,
        rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 16), (2, 1, 6)])
def test_rope_write_kv_is_bit_identical_to_the_reference(
    heads: int, kv_heads: int, head_dim: int, pool_dtype: torch.dtype
) -> None:
    # float16 pools: the kernel rounds as torch's cast does (to nearest even), 8 lanes at a
    # time and in its scalar tail (a head dim of 6 leaves a tail).
    cfg = _config(heads, kv_heads, head_dim)
    rope = RotaryEmbedding(cfg, torch.float32)
    tokens, blocks, block = 11, 6, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)
    qkv[0, -4:] = torch.tensor([1e5, -1e5, 1e-8, 2049.0])  # overflow, underflow, a tie
    positions = torch.randint(0, 256, (tokens,))
    slots = torch.randperm(blocks * block)[:tokens]
    slot_blocks, slot_offsets = slots // block, slots % block
    pools = [torch.zeros(blocks, block, kv_heads, head_dim, dtype=pool_dtype) for _ in range(4)]

    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    cos, sin = rope.tables(positions)
    q = rope.apply(qkv[:, :q_size].view(tokens, heads, head_dim), cos, sin)
    k = rope.apply(qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim), cos, sin)
    v = qkv[:, q_size + kv_size :].view(tokens, kv_heads, head_dim)
    write_kv(pools[0], pools[1], k, v, slot_blocks, slot_offsets)

    fused = qkv.clone()
    layer_ops.rope_write_kv(
        fused, rope.cos, rope.sin, positions, pools[2], pools[3], slot_blocks, slot_offsets,
        heads, kv_heads,
    )  # fmt: skip
    assert torch.equal(fused[:, :q_size], q.reshape(tokens, -1))
    assert torch.equal(fused[:, q_size : q_size + kv_size], k.reshape(tokens, -1))
    assert torch.equal(fused[:, q_size + kv_size :], qkv[:, q_size + kv_size :])
    assert torch.equal(pools[2], pools[0]) and torch.equal(pools[3], pools[1])


def test_checks_reject_bad_inputs() -> None:
    cfg = _config(2, 1, 8)
    rope = RotaryEmbedding(cfg, torch.float32)
    pool = torch.zeros(2, 4, 1, 8)
    qkv = torch.randn(3, 32)
    ids = torch.tensor([0, 1, 2])

    def call(**over: torch.Tensor) -> None:
        args = {"positions": ids, "slot_blocks": ids.clamp(max=1), "slot_offsets": ids}
        args.update(over)
        layer_ops.rope_write_kv(
            qkv, rope.cos, rope.sin, args["positions"], pool, pool.clone(),
            args["slot_blocks"], args["slot_offsets"], 2, 1,
        )  # fmt: skip

    call()
    with pytest.raises(ValueError, match="out of range"):
        call(positions=torch.tensor([0, 1, 256]))
    with pytest.raises(ValueError, match="out of range"):
        call(slot_blocks=torch.tensor([0, 2, 0]))
    with pytest.raises(ValueError, match="out of range"):
        call(slot_offsets=torch.tensor([0, 4, 0]))
    with pytest.raises(ValueError, match="int64"):
        call(positions=ids.int())
    with pytest.raises(ValueError, match=r"\[rows, 32\]"):
        layer_ops.rope_write_kv(qkv[:, :16].contiguous(), rope.cos, rope.sin, ids, pool,
                                pool, ids, ids, 2, 1)  # fmt: skip
    with pytest.raises(ValueError, match="float32 or float16"):
        layer_ops.rope_write_kv(qkv, rope.cos, rope.sin, ids, pool.bfloat16(), pool.bfloat16(),
                                ids.clamp(max=1), ids, 2, 1)  # fmt: skip
    with pytest.raises(ValueError, match="v_pool"):
        layer_ops.rope_write_kv(qkv, rope.cos, rope.sin, ids, pool, pool.half(),
                                ids.clamp(max=1), ids, 2, 1)  # fmt: skip
    with pytest.raises(ValueError, match="contiguous float32"):
        layer_ops.rms_norm(torch.randn(4, 3).t(), torch.ones(4), EPS)
    with pytest.raises(ValueError, match="weight"):
        layer_ops.rms_norm(torch.randn(2, 4), torch.ones(5), EPS)
    with pytest.raises(ValueError, match="match"):
        layer_ops.add_rms_norm(torch.randn(2, 4), torch.randn(3, 4), torch.ones(4), EPS)
    with pytest.raises(ValueError, match="even"):
        layer_ops.silu_mul(torch.randn(2, 5))

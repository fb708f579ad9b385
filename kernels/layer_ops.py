"""Checking launchers for the fused per-layer CPU ops of ``csrc/layer_ops.cpp``.

Each has a torch reference (``engine/model.py``'s ``_rms_norm``, ``engine/rope.py``,
``kernels.reference.write_kv``) and is tested against it (tests/kernels/test_layer_ops.py).
All take float32 contiguous CPU tensors, except the KV pools ``rope_write_kv`` stores into,
which may also be float16.
"""

from __future__ import annotations

import torch

from kernels.extension import Extension
from kernels.paged_attention import check_pools

_EXTENSION = Extension("layer_ops", ("-ffp-contract=off", "-fopenmp-simd", "-fno-math-errno"))


def layer_ops_available() -> bool:
    return _EXTENSION.load() is not None


def _check_rows(name: str, t: torch.Tensor, width: int | None = None) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous float32 CPU tensor")
    if t.dim() != 2 or (width is not None and t.shape[1] != width):
        raise ValueError(f"{name} must be [rows, {width or 'H'}], got {tuple(t.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x * rsqrt(mean(x^2) + eps)`` row by row; ``x`` ``[M, H]``."""
    _check_rows("x", x)
    if weight.shape != (x.shape[1],) or weight.dtype != torch.float32:
        raise ValueError(f"weight must be float32 [{x.shape[1]}]")
    out = torch.empty_like(x)
    _EXTENSION.require().rms_norm(out, x, weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``x += delta`` in place (the residual stream), then ``rms_norm(x)``."""
    _check_rows("x", x)
    _check_rows("delta", delta, x.shape[1])
    if delta.shape != x.shape:
        raise ValueError(f"delta {tuple(delta.shape)} must match x {tuple(x.shape)}")
    if weight.shape != (x.shape[1],) or weight.dtype != torch.float32:
        raise ValueError(f"weight must be float32 [{x.shape[1]}]")
    out = torch.empty_like(x)
    _EXTENSION.require().add_rms_norm(out, x, delta, weight, eps)
    return out


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """The sum of each row of ``x`` (``[B, V]``): ``[B]``, each row in one fixed order, so
    the same bits whatever the batch or the thread count."""
    _check_rows("x", x)
    out = x.new_empty((x.shape[0],))
    _EXTENSION.require().row_sums(out, x)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for fused ``[M, 2 I]`` rows (gate first): ``[M, I]``."""
    _check_rows("gate_up", gate_up)
    if gate_up.shape[1] % 2:
        raise ValueError("gate_up rows hold gate and up: an even width")
    out = gate_up.new_empty((gate_up.shape[0], gate_up.shape[1] // 2))
    _EXTENSION.require().silu_mul(out, gate_up)
    return out


def rope_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    ranges_checked: bool = False,
) -> None:
    """Rotate q and k in place in ``qkv`` ``[T, (Hq + 2 Hkv) D]`` by the rows of the
    ``[max_pos, D]`` tables at ``positions``, then store each token's k and v at its slot
    of the pools ``[N, block, Hkv, D]`` (float32, or float16: rounded to nearest even, the
    values ``write_kv``'s cast stores). ``ranges_checked``: the caller has checked the
    positions and slots of this batch once for all layers (``check_slot_ranges``)."""
    d = cos.shape[1] if cos.dim() == 2 else 0
    _check_rows("qkv", qkv, (num_heads + 2 * num_kv_heads) * d)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 tensor")
    check_pools(k_pool, v_pool)
    if sin.shape != cos.shape or d % 2:
        raise ValueError("cos and sin must be equal [max_pos, D] tables with D even")
    pool_shape = (k_pool.shape[0], k_pool.shape[1], num_kv_heads, d)
    if k_pool.dim() != 4 or tuple(k_pool.shape) != pool_shape or v_pool.shape != k_pool.shape:
        raise ValueError(f"pools must be [N, block, {num_kv_heads}, {d}]")
    t = qkv.shape[0]
    for name, idx in (("positions", positions), ("slot_blocks", slot_blocks),
                      ("slot_offsets", slot_offsets)):  # fmt: skip
        if idx.dtype != torch.int64 or idx.shape != (t,) or not idx.is_contiguous():
            raise ValueError(f"{name} must be contiguous int64 [{t}]")
    if not ranges_checked:
        check_slot_ranges(positions, slot_blocks, slot_offsets, cos.shape[0], k_pool.shape[:2])
    _EXTENSION.require().rope_write_kv(
        qkv, cos, sin, positions, k_pool, v_pool, slot_blocks, slot_offsets,
        num_heads, num_kv_heads,
    )  # fmt: skip


def check_slot_ranges(
    positions: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    max_positions: int,
    pool_blocks: tuple[int, int] | torch.Size,
) -> None:
    """Positions index the RoPE tables and slots ``(block, offset)`` lie inside the pool."""
    if positions.numel() and not (
        0 <= int(positions.min()) and int(positions.max()) < max_positions
        and 0 <= int(slot_blocks.min()) and int(slot_blocks.max()) < pool_blocks[0]
        and 0 <= int(slot_offsets.min()) and int(slot_offsets.max()) < pool_blocks[1]
    ):  # fmt: skip
        raise ValueError("a position or KV slot is out of range")

"""Input checks the Triton launchers share; each failure is a ``ValueError`` naming the input.

Why the launchers check so much: a Triton kernel reads and writes raw pointers, so a wrong
stride, dtype or block id is silent memory corruption on a GPU, never an exception.
"""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        got = str(t.dtype).removeprefix("torch.")
        raise ValueError(f"{name} must be one of {names}, got {got}")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


def check_dim(name: str, t: torch.Tensor, ndim: int, what: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {what}, got shape {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, and one Triton can run on: CUDA, or the CPU only under
    ``TRITON_INTERPRET=1`` (a compiled kernel dereferences CPU pointers on the GPU)."""
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        listed = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"inputs must share one device: {listed}")
    if first.type == "cpu" and not interpreting():
        raise ValueError("CPU tensors need TRITON_INTERPRET=1 (set before importing triton)")
    if first.type not in ("cpu", "cuda"):
        raise ValueError(f"Triton kernels run on cuda (or cpu when interpreted), not {first}")
    return first


def check_rows_contiguous(name: str, t: torch.Tensor, inner: int) -> None:
    """The last ``inner`` dims are packed (row-major, no gaps): kernels address them as one
    run of ``prod(shape[-inner:])`` elements; outer dims may have any stride."""
    expected = 1
    for size, stride in zip(reversed(t.shape[-inner:]), reversed(t.stride()[-inner:]), strict=True):
        if size > 1 and stride != expected:
            raise ValueError(
                f"{name}'s last {inner} dims must be contiguous, got strides {t.stride()}"
            )
        expected *= size


def check_pools(k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
    """One layer's key and value pools: ``[num_blocks, block_size, kv_heads, head_dim]``, a
    float dtype, blocks packed, and equal shapes, dtypes and strides (kernels address both
    with one set of strides)."""
    check_dim("k_pool", k_pool, 4, "[num_blocks, block_size, kv_heads, head_dim]")
    check_shape("v_pool", v_pool, tuple(k_pool.shape))
    check_dtype("k_pool", k_pool, FLOAT_DTYPES)
    check_dtype("v_pool", v_pool, (k_pool.dtype,))
    check_rows_contiguous("k_pool", k_pool, 3)
    if k_pool.stride() != v_pool.stride():
        raise ValueError(f"k_pool and v_pool strides differ: {k_pool.stride()}, {v_pool.stride()}")


def check_index_range(name: str, t: torch.Tensor, low: int, high: int) -> None:
    """Every entry in ``[low, high)``; the reduction syncs with the device, once per call."""
    if t.numel() and (int(t.min()) < low or int(t.max()) >= high):
        raise ValueError(
            f"{name} out of range: entries in [{int(t.min())}, {int(t.max())}], "
            f"allowed [{low}, {high})"
        )


def interpreting() -> bool:
    """Whether triton runs kernels in its interpreter (parsed as triton's C++ getenv_bool)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on")

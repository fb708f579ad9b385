"""Linear layers over GGUF-quantized weights kept as packed blocks, and their checking launchers.

A ``QuantizedWeight`` is a checkpoint tensor's bytes as stored (llama.cpp's block layout),
viewed as ``[out_features, row_bytes]``. ``qlinear`` multiplies by it in float32: the C++
kernels of ``csrc/quant_linear.cpp`` dequantize blocks as they go (a fused kernel for a few
rows, each weight byte read once per call; a tiled one for more), and a long prompt's
hundreds of rows run torch's GEMM on dequantized panels of W, freed after the call.
``dequantize`` gives the dense float32 weight, element for element equal to
``gguf.quants.dequantize`` (the same float32 operations in the same order), which is what
makes a quantized worker compute with the same numbers as a float32 one.

``QuantLinear`` is the engine's layer (the interface of ``kernels.linear.PackedLinear``).
Types with a kernel: ``KERNEL_TYPES``; anything else stays dense (the loader decides).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kernels.extension import Extension

_EXTENSION = Extension("quant_linear", ("-ffp-contract=off", "-fno-math-errno"))

KERNEL_TYPES = (
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q6_K,
)
# Byte offsets of each block's float16 scales (d, and the min or dmin where there is one).
_SCALE_OFFSETS = {
    GGMLQuantizationType.Q8_0: (0,),
    GGMLQuantizationType.Q4_0: (0,),
    GGMLQuantizationType.Q4_1: (0, 2),
    GGMLQuantizationType.Q4_K: (0, 2),
    GGMLQuantizationType.Q6_K: (208,),
}


def kernel_available() -> bool:
    return _EXTENSION.load() is not None


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A ``[out_features, in_features]`` weight as packed GGUF blocks, ``data`` uint8
    ``[out_features, in_features / block_elems * block_bytes]``. Construction checks the
    shape (a truncated row is an error) and every block's scales (a corrupt one, not finite,
    is an error naming the first bad block)."""

    qtype: GGMLQuantizationType
    shape: tuple[int, int]
    data: torch.Tensor

    def __post_init__(self) -> None:
        if self.qtype not in KERNEL_TYPES:
            raise ValueError(f"no quantized kernel for {self.qtype.name}")
        out_f, in_f = self.shape
        elems, size = GGML_QUANT_SIZES[self.qtype]
        if in_f % elems:
            raise ValueError(
                f"{self.qtype.name} rows hold whole blocks of {elems}; in_features is {in_f}"
            )
        row_bytes = in_f // elems * size
        d = self.data
        if d.dtype != torch.uint8 or d.device.type != "cpu" or not d.is_contiguous():
            raise ValueError("quantized data must be a contiguous uint8 CPU tensor")
        if tuple(d.shape) != (out_f, row_bytes):
            raise ValueError(
                f"{self.qtype.name} weight {out_f}x{in_f} needs {out_f}x{row_bytes} bytes, "
                f"got {tuple(d.shape)} (truncated or misshapen)"
            )
        blocks = d.numpy().reshape(-1, size)
        for offset in _SCALE_OFFSETS[self.qtype]:
            scales = blocks[:, offset : offset + 2].copy().view(np.float16)
            bad = np.flatnonzero(~np.isfinite(scales))
            if bad.size:
                first = int(bad[0])
                raise ValueError(
                    f"{self.qtype.name} block {first} (row {first * elems // in_f}) has a "
                    f"non-finite scale {float(scales.reshape(-1)[first])}: corrupt data"
                )

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @staticmethod
    def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows of several weights of one type and width stacked (e.g. q, k, v into qkv)."""
        first = parts[0]
        if any(p.qtype != first.qtype or p.shape[1] != first.shape[1] for p in parts):
            raise ValueError("only weights of one type and width can be stacked")
        rows = sum(p.shape[0] for p in parts)
        data = torch.cat([p.data for p in parts], dim=0)
        return QuantizedWeight(first.qtype, (rows, first.shape[1]), data)


KERNELS = ("fused", "tiled", "portable")  # the C++ kernels, in csrc/quant_linear.cpp's order
FUSED_ROWS = 4  # products of up to this many rows run the fused kernel, larger the tiled
GEMM_ROWS = 256  # from this many rows (prompts) dequantize + torch's GEMM beats the tiled
GEMM_PANEL_BYTES = 8 << 20  # the dense float32 rows of W that "gemm" holds at a time


def kernel_for(rows: int) -> str:
    """The way ``qlinear``'s ``"auto"`` runs a product of ``rows`` input rows."""
    return "fused" if rows <= FUSED_ROWS else "tiled" if rows < GEMM_ROWS else "gemm"


def qlinear(x: torch.Tensor, w: QuantizedWeight, *, kernel: str = "auto") -> torch.Tensor:
    """``x @ W^T`` for ``x`` float32 ``[M, in_features]``: ``[M, out_features]`` float32.

    ``kernel``: ``"fused"`` dequantizes in registers and reads each weight byte once (the
    fastest for a few rows), ``"tiled"`` dequantizes a few rows of W at a time into a tile
    and runs a register-blocked kernel over every input row (the fastest past
    ``FUSED_ROWS``: measured 2026-12-05, docs/benchmarks.md), ``"portable"`` the plain C++ path
    (what every kernel is on a CPU without AVX2; tests use it), ``"gemm"`` dequantizes
    panels of W's rows (``GEMM_PANEL_BYTES`` at a time, freed after the call) and runs
    torch's GEMM on them (the fastest from ``GEMM_ROWS``, where each dequantized weight
    serves hundreds of rows), ``"auto"`` picks by size. Within one of the C++ kernels a
    row's output does not depend on the batch's other rows; torch's GEMM gives no such
    promise."""
    out_f, in_f = w.shape
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != in_f:
        raise ValueError(
            f"quantized linear takes float32 [M, {in_f}], got {x.dtype} {tuple(x.shape)}"
        )
    if x.device.type != "cpu":
        raise ValueError("quantized linear runs on CPU tensors")
    m = x.shape[0]
    if kernel == "auto":
        kernel = kernel_for(m)
    if kernel == "gemm":
        return _panel_gemm(x, w)
    if kernel not in KERNELS:
        raise ValueError(f"kernel is one of {(*KERNELS, 'gemm')} or 'auto', got {kernel!r}")
    out = x.new_empty((m, out_f))
    if m:
        mod = _EXTENSION.require()
        mod.qlinear(out, x.contiguous(), w.data, int(w.qtype), KERNELS.index(kernel))
    return out


def _panel_gemm(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """``x @ W^T`` by torch's GEMM over dense panels of W's rows, one panel alive at a time."""
    out_f, in_f = w.shape
    rows = max(1, GEMM_PANEL_BYTES // (4 * in_f))
    if rows >= out_f:  # one panel: the whole weight (every layer of the default model)
        return torch.nn.functional.linear(x, dequantize(w))
    out = x.new_empty((x.shape[0], out_f))
    mod = _EXTENSION.require()
    panel = torch.empty((rows, in_f), dtype=torch.float32)
    for n0 in range(0, out_f, rows):
        n1 = min(out_f, n0 + rows)
        dense = panel[: n1 - n0]
        mod.dequantize(dense, w.data[n0:n1], int(w.qtype), False)
        out[:, n0:n1] = torch.nn.functional.linear(x, dense)
    return out


def dequantize(
    w: QuantizedWeight, *, portable: bool = False, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The dense float32 ``[out_features, in_features]`` weight (into ``out`` if given)."""
    if out is None:
        out = torch.empty(w.shape, dtype=torch.float32)
    elif out.dtype != torch.float32 or tuple(out.shape) != w.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 {w.shape} tensor")
    _EXTENSION.require().dequantize(out, w.data, int(w.qtype), portable)
    return out


def dequantize_rows(w: QuantizedWeight, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (int64 ``[R]``) of the weight as float32 ``[R, in_features]``: an
    embedding lookup that never makes the dense table."""
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= w.shape[0]):
        raise IndexError(f"row index out of range for a weight of {w.shape[0]} rows")
    picked = w.data.index_select(0, rows.reshape(-1))
    out = torch.empty((rows.numel(), w.shape[1]), dtype=torch.float32)
    if rows.numel():
        _EXTENSION.require().dequantize(out, picked, int(w.qtype), False)
    return out.reshape(*rows.shape, w.shape[1])


class QuantLinear:
    """``y = x @ W^T`` over packed blocks, ``x`` float32 ``[M, in]`` (the interface of
    ``kernels.linear.PackedLinear``): ``qlinear`` with the kernel picked by size. No dense
    copy of the weight outlives a call (a long prompt's product dequantizes a panel of at
    most ``GEMM_PANEL_BYTES``), so a quantized model holds only its blocks."""

    __slots__ = ("in_features", "kernel", "out_features", "weight")

    def __init__(self, weight: QuantizedWeight, *, kernel: str = "auto") -> None:
        self.weight = weight
        self.kernel = kernel
        self.out_features, self.in_features = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return qlinear(x, self.weight, kernel=self.kernel)

    def dense(self) -> torch.Tensor:
        return dequantize(self.weight)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

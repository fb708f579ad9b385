"""Linear layers over GGUF-quantized weights kept as packed blocks, and their checking launchers.

A ``QuantizedWeight`` is a checkpoint tensor's bytes as stored (llama.cpp's block layout),
viewed as ``[out_features, row_bytes]``. ``qlinear`` runs ``csrc/quant_linear.cpp``: it
dequantizes each block in registers and accumulates in float32, reading every weight byte
once per call. ``dequantize`` gives the dense float32 weight, element for element equal to
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


def qlinear(x: torch.Tensor, w: QuantizedWeight, *, portable: bool = False) -> torch.Tensor:
    """``x @ W^T`` for ``x`` float32 ``[M, in_features]``: ``[M, out_features]`` float32.

    ``portable`` runs the plain C++ path even where the AVX2 one exists (tests use it)."""
    out_f, in_f = w.shape
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != in_f:
        raise ValueError(
            f"quantized linear takes float32 [M, {in_f}], got {x.dtype} {tuple(x.shape)}"
        )
    if x.device.type != "cpu":
        raise ValueError("quantized linear runs on CPU tensors")
    out = x.new_empty((x.shape[0], out_f))
    if x.shape[0]:
        _EXTENSION.require().qlinear(out, x.contiguous(), w.data, int(w.qtype), portable)
    return out


def dequantize(w: QuantizedWeight, *, portable: bool = False) -> torch.Tensor:
    """The dense float32 ``[out_features, in_features]`` weight."""
    out = torch.empty(w.shape, dtype=torch.float32)
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


class DenseScratch:
    """One reusable float32 buffer that large-batch products dequantize a weight into.

    Shared by every layer of one model: one engine loop drives the model, so one product
    at a time uses it. It grows to the largest weight that asks and stays that size, except
    that a weight larger than what it holds once reserved (the LM head) is dequantized and
    multiplied a panel of rows at a time (``panel_rows``)."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.float32)

    def reserve(self, numel: int) -> None:
        """Allocate now (at load time, so the worker's memory is known before it serves)."""
        self.take((numel, 1))

    def take(self, shape: tuple[int, int]) -> torch.Tensor:
        numel = shape[0] * shape[1]
        if self._buffer.numel() < numel:
            self._buffer = torch.empty(numel, dtype=torch.float32)
        return self._buffer[:numel].view(shape)

    def panel_rows(self, out_features: int, in_features: int) -> int:
        """Rows of an ``[out, in]`` weight that one dequantized panel holds: all of them when
        the buffer holds them or is still empty (it then grows), else as many as fit."""
        held = self._buffer.numel() // in_features
        return out_features if held == 0 or held >= out_features else held

    @property
    def nbytes(self) -> int:
        return self._buffer.numel() * 4


class QuantLinear:
    """``y = x @ W^T`` over packed blocks, ``x`` float32 ``[M, in]``.

    Up to ``DENSE_ROWS`` rows (decode batches, short prompts) run the fused kernel
    (``fused``), which reads the packed weight once and shares each dequantized vector over
    8 rows. More rows dequantize the weight into ``scratch`` and run torch's GEMM
    (``dense_gemm``): past ~24 rows the GEMM's register blocking outruns the fused kernel
    by more than the dequantizing costs (``python -m bench.quant_products``, in
    docs/benchmarks.md). Without a scratch every batch runs the fused kernel. A weight
    larger than the scratch holds (the LM head, whose dense copy would cost more memory than
    the packed model) is dequantized and multiplied a panel of rows at a time.

    The fused kernel adds a row's terms in the same order whatever else is in the batch;
    torch's GEMM may not, so batches of more than ``DENSE_ROWS`` rows can differ from
    smaller ones in the last bits."""

    DENSE_ROWS = 24

    __slots__ = ("in_features", "out_features", "scratch", "weight")

    def __init__(self, weight: QuantizedWeight, scratch: DenseScratch | None = None) -> None:
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.scratch = scratch

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scratch is not None and x.dim() == 2 and x.shape[0] > self.DENSE_ROWS:
            return self.dense_gemm(x)
        return self.fused(x)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        return qlinear(x, self.weight)

    def dense_gemm(self, x: torch.Tensor) -> torch.Tensor:
        if self.scratch is None:
            raise ValueError("this layer has no scratch to dequantize its weight into")
        n, k = self.weight.shape
        mod, qtype = _EXTENSION.require(), int(self.weight.qtype)
        rows = self.scratch.panel_rows(n, k)
        parts = []
        for r0 in range(0, n, rows):  # one panel unless the weight is larger than the scratch
            packed = self.weight.data[r0 : r0 + rows]
            panel = self.scratch.take((packed.shape[0], k))
            mod.dequantize(panel, packed, qtype, False)
            parts.append(torch.nn.functional.linear(x, panel))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def dense(self) -> torch.Tensor:
        return dequantize(self.weight)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

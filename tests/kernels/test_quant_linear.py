"""kernels.quant_linear: every quant type against gguf's dequantize-then-matmul reference.

Weights are random block bytes with finite float16 scales: every nibble, sign and 6-bit
scale pattern a real file can hold. Dequantization must be bit-identical to gguf-py's (the
same float32 operations in the same order); products equal ``x @ dequantized^T`` up to the
order of float32 additions.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from kernels import quant_linear
from kernels.extension import isa_flags
from kernels.quant_linear import (
    FUSED_ROWS,
    GEMM_ROWS,
    KERNEL_TYPES,
    QuantizedWeight,
    QuantLinear,
    dequantize,
    dequantize_rows,
    kernel_available,
    qlinear,
)
from tests.quant_blocks import SCALE_OFFSETS, random_blocks

RTOL = 2e-6  # of the largest |output|: float32 sums of a few thousand terms, reordered


def weight(qtype: Q, rows: int, cols: int, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    raw = random_blocks(qtype, rows, cols, seed)
    ref = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
    return QuantizedWeight(qtype, (rows, cols), torch.from_numpy(raw)), torch.from_numpy(ref)


def assert_product(got: torch.Tensor, x: torch.Tensor, ref: torch.Tensor) -> None:
    want = x.double() @ ref.double().T
    assert got.shape == want.shape
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err.item() < RTOL, f"relative error {err.item():.2e}"


def widths(qtype: Q) -> list[int]:
    """Odd block counts per row: one block, three, and a width the model uses."""
    elems = GGML_QUANT_SIZES[qtype][0]
    return [elems, 3 * elems, 576 if elems == 32 else 768]


def test_kernel_builds_here() -> None:
    assert kernel_available()


@pytest.mark.parametrize("portable", [False, True], ids=["avx2", "portable"])
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_dequantize_is_bit_identical_to_gguf(qtype: Q, portable: bool) -> None:
    for i, cols in enumerate(widths(qtype)):
        w, ref = weight(qtype, 37, cols, seed=i)
        assert torch.equal(dequantize(w, portable=portable), ref)


@pytest.mark.parametrize("kernel", ["fused", "tiled", "portable"])
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_qlinear_matches_dequantize_then_matmul(qtype: Q, kernel: str) -> None:
    g = torch.Generator().manual_seed(int(qtype))
    for i, cols in enumerate(widths(qtype)):
        rows = (7, 33, 130)[i]  # ragged: not a multiple of any tile
        w, ref = weight(qtype, rows, cols, seed=10 + i)
        # 1..64 rows; 131: the tiled kernel's panels of 64 rows, the last one ragged
        for m in (1, 2, 3, 4, 5, 7, 8, 9, 17, 64, 131):
            x = torch.randn(m, cols, generator=g)
            assert_product(qlinear(x, w, kernel=kernel), x, ref)


@pytest.mark.parametrize("kernel", ["fused", "tiled"])
def test_batch_rows_do_not_depend_on_each_other(kernel: str) -> None:
    # A row's output must not change with what else is in the batch (batch invariance is
    # what keeps a sequence's tokens independent of its neighbours), nor with the threads.
    w, _ = weight(Q.Q4_1, 50, 576, seed=3)
    x = torch.randn(70, 576)
    batch = qlinear(x, w, kernel=kernel)
    alone = torch.cat([qlinear(x[i : i + 1], w, kernel=kernel) for i in range(70)])
    assert torch.equal(batch, alone)
    # Every way the tiled kernel cuts a panel into passes (1..6 rows each, spread evenly)
    for m in range(2, 14):
        assert torch.equal(qlinear(x[:m], w, kernel=kernel), alone[:m]), f"{m} rows"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(qlinear(x, w, kernel=kernel), batch)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_long_prompts_run_torch_gemm_on_dequantized_panels(
    qtype: Q, monkeypatch: pytest.MonkeyPatch
) -> None:
    cols = widths(qtype)[1]
    w, ref = weight(qtype, 37, cols, seed=3)
    x = torch.randn(300, cols, generator=torch.Generator().manual_seed(3))
    panels: list[int] = []  # the weight rows of each torch GEMM the product ran
    linear = torch.nn.functional.linear

    def gemm(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        panels.append(dense.shape[0])
        return linear(x, dense)

    monkeypatch.setattr(torch.nn.functional, "linear", gemm)
    assert_product(qlinear(x, w, kernel="gemm"), x, ref)
    assert panels == [37]  # one panel: the whole weight
    panels.clear()
    monkeypatch.setattr(quant_linear, "GEMM_PANEL_BYTES", 8 * 4 * cols)
    panelled = qlinear(x, w, kernel="gemm")
    assert panels == [8, 8, 8, 8, 5]
    # each panel's columns, not bits of the one-panel product: the BLAS blocks by shape and ISA
    for n0 in range(0, 37, 8):
        assert_product(panelled[:, n0 : n0 + 8], x, ref[n0 : n0 + 8])
    assert qlinear(x[:0], w, kernel="gemm").shape == (0, 37)
    with pytest.raises(ValueError, match="'gemm'"):
        qlinear(x, w, kernel="blas")


def test_quant_linear_picks_the_kernel_by_rows() -> None:
    w, ref = weight(Q.Q4_K, 96, 512, seed=5)
    layer = QuantLinear(w)
    for m in (1, FUSED_ROWS, FUSED_ROWS + 1, 40, GEMM_ROWS - 1, GEMM_ROWS, GEMM_ROWS + 70):
        x = torch.randn(m, 512)
        kernel = "fused" if m <= FUSED_ROWS else "tiled" if m < GEMM_ROWS else "gemm"
        assert torch.equal(layer(x), qlinear(x, w, kernel=kernel)), m
        assert_product(layer(x), x, ref)
    assert torch.equal(layer.dense(), ref)
    buf = torch.empty(96, 512)
    assert dequantize(w, out=buf) is buf and torch.equal(buf, ref)
    with pytest.raises(ValueError, match="contiguous float32"):
        dequantize(w, out=torch.empty(512, 96))
    assert layer.nbytes == w.data.numel()  # the packed blocks only: no dense copy
    with pytest.raises(ValueError, match="kernel is one of"):
        qlinear(torch.randn(2, 512), w, kernel="dense")


def test_concat_stacks_rows() -> None:
    a, ra = weight(Q.Q8_0, 5, 64, seed=1)
    b, rb = weight(Q.Q8_0, 3, 64, seed=2)
    both = QuantizedWeight.concat([a, b])
    assert both.shape == (8, 64)
    assert torch.equal(dequantize(both), torch.cat([ra, rb]))
    c, _ = weight(Q.Q4_0, 3, 64)
    with pytest.raises(ValueError, match="one type"):
        QuantizedWeight.concat([a, c])


def test_dequantize_rows_is_an_embedding_lookup() -> None:
    w, ref = weight(Q.Q8_0, 40, 96, seed=4)
    ids = torch.tensor([3, 0, 39, 3])
    assert torch.equal(dequantize_rows(w, ids), ref[ids])
    assert dequantize_rows(w, torch.tensor([], dtype=torch.int64)).shape == (0, 96)
    with pytest.raises(IndexError):
        dequantize_rows(w, torch.tensor([40]))
    with pytest.raises(IndexError):
        dequantize_rows(w, torch.tensor([-1]))


def test_truncated_rows_are_rejected() -> None:
    raw = torch.from_numpy(random_blocks(Q.Q4_1, 4, 64, seed=0))
    with pytest.raises(ValueError, match="truncated"):
        QuantizedWeight(Q.Q4_1, (4, 64), raw[:, :-1].contiguous())
    with pytest.raises(ValueError, match="truncated"):
        QuantizedWeight(Q.Q4_1, (5, 64), raw)
    with pytest.raises(ValueError, match="whole blocks"):
        QuantizedWeight(Q.Q4_K, (4, 300), raw)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_corrupt_block_scale_is_rejected(qtype: Q, bad: float) -> None:
    elems, size = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 3, 2 * elems, seed=1)
    blocks = raw.reshape(-1, size)
    offset = SCALE_OFFSETS[qtype][-1]
    blocks[4, offset : offset + 2] = np.array([bad], dtype=np.float16).view(np.uint8)
    with pytest.raises(ValueError, match=r"block 4 \(row 2\).*corrupt"):
        QuantizedWeight(qtype, (3, 2 * elems), torch.from_numpy(raw))


def test_unsupported_type_and_bad_inputs() -> None:
    with pytest.raises(ValueError, match="no quantized kernel for Q5_0"):
        QuantizedWeight(Q.Q5_0, (1, 32), torch.zeros(1, 22, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        QuantizedWeight(Q.Q8_0, (1, 32), torch.zeros(1, 34, dtype=torch.int16))
    w, _ = weight(Q.Q8_0, 4, 64)
    with pytest.raises(ValueError, match=r"float32 \[M, 64\]"):
        qlinear(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match=r"float32 \[M, 64\]"):
        qlinear(torch.randn(2, 64, dtype=torch.float64), w)
    assert qlinear(torch.randn(0, 64), w).shape == (0, 4)
    x = torch.randn(64, 3).t()  # not contiguous
    assert_product(qlinear(x, w), x, dequantize(w))


@pytest.mark.slow
def test_an_avx2_only_build_is_right_where_the_cpu_has_avx512(tmp_path: Path) -> None:
    # Where the CPU has AVX-512VL the tiled kernel runs 16 lanes wide in passes of up to 6
    # rows; an AVX2-only CPU runs 8 lanes in passes of up to 3, code the other tests here do
    # not reach on such a CPU. Build it and check it: products within the reference's
    # tolerance (the fused kernel's too), rows independent of the batch for every way of
    # cutting a panel, and dequantized weights bit-equal to this build's.
    from kernels.extension import isa_for
    from kernels.quant_linear import _EXTENSION, KERNELS

    if isa_flags()[0] != "avx512":
        pytest.skip("this CPU builds the AVX2 kernel already: the other tests cover it")
    avx2_flags = isa_for({"avx2", "fma", "f16c"})[1]
    avx2 = _EXTENSION.compile("quant_linear_avx2_only", avx2_flags, build_directory=tmp_path)

    def product(x: torch.Tensor, w: QuantizedWeight, kernel: str) -> torch.Tensor:
        out = torch.empty(x.shape[0], w.shape[0])
        avx2.qlinear(out, x, w.data, int(w.qtype), KERNELS.index(kernel))
        return out

    g = torch.Generator().manual_seed(7)
    for qtype in KERNEL_TYPES:
        w, _ = weight(qtype, 33, widths(qtype)[1], seed=int(qtype))
        dense = torch.empty(w.shape)
        avx2.dequantize(dense, w.data, int(qtype), False)
        assert torch.equal(dense, dequantize(w)), qtype.name
        x = torch.randn(70, w.shape[1], generator=g)
        tiled = product(x, w, "tiled")
        assert_product(tiled, x, dense)
        alone = torch.cat([product(x[i : i + 1], w, "tiled") for i in range(70)])
        for m in (*range(1, 14), 64, 70):
            assert torch.equal(product(x[:m], w, "tiled"), alone[:m]), f"{qtype.name}, {m} rows"
        for m in (1, 3, FUSED_ROWS):
            assert_product(product(x[:m], w, "fused"), x[:m], dense)

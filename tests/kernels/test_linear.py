"""kernels.linear.PackedLinear: the packed oneDNN path equals F.linear up to float32 rounding;
pack=False keeps it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.linear import PackedLinear, packing_available

RTOL = 2e-6  # of the largest |output|: float32 sums of up to 130 terms, in either library's order


def assert_product(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    want = x.double() @ w.double().T
    assert got.shape == want.shape
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err.item() < RTOL, f"relative error {err.item():.2e}"


def test_packing_is_available_on_this_build() -> None:
    # The CPU torch wheel this project pins ships oneDNN; if this fails the engine silently
    # loses its fast path, which a benchmark would notice only much later.
    assert packing_available()


@pytest.mark.parametrize("rows", [1, 3, 8, 32, 33, 200])
@pytest.mark.parametrize(("out_f", "in_f"), [(96, 64), (257, 130), (1000, 48)])
def test_packed_matches_f_linear(rows: int, out_f: int, in_f: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + out_f)
    w = torch.randn(out_f, in_f, generator=g)
    x = torch.randn(rows, in_f, generator=g)
    lin = PackedLinear(w)
    assert lin.packed
    got = lin(x)
    assert got.shape == (rows, out_f)
    # oneDNN and MKL (F.linear) sum in their own orders, by shape and ISA: each against float64
    assert_product(got, x, w)
    assert_product(F.linear(x, w), x, w)


def test_non_contiguous_input_and_empty_batch() -> None:
    w = torch.randn(40, 24)
    lin = PackedLinear(w)
    x = torch.randn(24, 9).t()  # [9, 24], not contiguous
    assert_product(lin(x), x, w)
    assert lin(torch.randn(0, 24)).shape == (0, 40)


def test_dense_round_trip_and_plain_path() -> None:
    w = torch.randn(17, 11)
    assert torch.equal(PackedLinear(w).dense(), w)
    plain = PackedLinear(w, pack=False)
    assert not plain.packed
    x = torch.randn(5, 11)
    assert torch.equal(plain(x), F.linear(x, w))


def test_non_float32_weights_are_not_packed() -> None:
    w = torch.randn(8, 4, dtype=torch.bfloat16)
    lin = PackedLinear(w)
    assert not lin.packed
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    assert torch.equal(lin(x), F.linear(x, w))


def test_bad_shapes_are_rejected() -> None:
    with pytest.raises(ValueError, match="2-D"):
        PackedLinear(torch.randn(3, 4, 5))
    lin = PackedLinear(torch.randn(6, 4))
    with pytest.raises(ValueError, match=r"float32 \[M, 4\]"):
        lin(torch.randn(2, 5))

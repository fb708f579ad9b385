"""Dense projections ``y = x @ W^T`` with the weight pre-packed for the CPU's GEMM.

At decode batch sizes (M = 8..64 rows) oneDNN's inner-product primitive on a weight
reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the
path torch's own inductor uses for CPU) is faster than torch's default CPU ``F.linear``
(MKL ``sgemm`` on a row-major weight), most of all on the tall LM head (docs/benchmarks.md,
engine), with results equal to ``F.linear`` up to float32 rounding.

``PackedLinear`` holds one weight and picks the path once: packed when the weight is a
float32 CPU tensor and oneDNN is available, unless its caller says ``pack=False`` (the
engine's ``cpu_kernels`` setting, which also turns off the C++ attention kernel); otherwise
plain ``F.linear``. The packed copy replaces the dense one, so memory does not grow.
"""

from __future__ import annotations

import structlog
import torch
import torch.nn.functional as F

log = structlog.get_logger(__name__)

# The reorder takes a batch-size hint; 32 packs well for every batch size the engine runs
# (1..1,024 rows).
BATCH_HINT = 32
_probe: bool | None = None


def packing_available() -> bool:
    """Whether packed oneDNN linears are usable here (checked once, on a tiny product)."""
    global _probe
    if _probe is None:
        _probe = _check()
    return _probe


def _check() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
        x = torch.arange(8, dtype=torch.float32).reshape(2, 4) / 5
        packed = torch.ops.mkldnn._reorder_linear_weight(w, BATCH_HINT)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(y, F.linear(x, w), rtol=1e-5, atol=1e-6))
    except Exception as e:  # an op missing from this torch build: keep F.linear
        log.warning("packed_linear_unavailable", error=str(e))
        return False


class PackedLinear:
    """``y = x @ weight^T`` for ``x`` ``[M, in]`` (any M >= 1); ``weight`` is ``[out, in]``."""

    __slots__ = ("in_features", "nbytes", "out_features", "packed", "weight")

    def __init__(self, weight: torch.Tensor, *, pack: bool | None = None) -> None:
        if weight.dim() != 2:
            raise ValueError(f"a linear weight is 2-D [out, in], got {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        if pack is None:
            pack = (
                weight.dtype == torch.float32
                and weight.device.type == "cpu"
                and packing_available()
            )
        self.packed = pack
        self.nbytes = weight.numel() * weight.element_size()  # the packed copy's size too
        weight = weight.contiguous()
        self.weight = (
            torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT) if pack else weight
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return F.linear(x, self.weight)
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"packed linear takes float32 [M, {self.in_features}], got "
                f"{x.dtype} {tuple(x.shape)}"
            )
        if x.shape[0] == 0:
            return x.new_empty((0, self.out_features))
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, None, "none", [], "")

    def dense(self) -> torch.Tensor:
        """The weight as an ordinary ``[out, in]`` tensor (a copy when packed)."""
        if not self.packed:
            return self.weight
        return self.weight.to_dense()

"""Random GGUF quantized blocks for tests: every nibble, sign and scale pattern a file can hold.

gguf-py cannot quantize the K-quants, so tests that need them (kernels, a tiny mixed-type
GGUF) use random block bytes whose float16 scales are finite and small.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

# Byte offsets of each block's float16 scales (d, and the min or dmin where there is one).
SCALE_OFFSETS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q4_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(qtype: Q, rows: int, cols: int, seed: int, scale: float = 0.02) -> np.ndarray:
    """``rows`` rows of random ``qtype`` blocks (``cols`` elements each), uint8
    ``[rows, row_bytes]``, with float16 scales drawn from N(0, ``scale``)."""
    elems, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // elems * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    for offset in SCALE_OFFSETS[qtype]:
        scales = (rng.standard_normal(len(blocks)) * scale).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw

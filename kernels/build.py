"""Compile every C++ CPU kernel now, so no engine start pays for it.

    python -m kernels.build

Prints one line per kernel and exits 1 when any could not be built (the engine would then
run that part on the torch reference). ``scripts/setup.sh`` and the container image run it.
"""

from __future__ import annotations

import sys

from kernels.layer_ops import layer_ops_available
from kernels.paged_attention import cpu_kernel_available
from kernels.quant_linear import kernel_available

KERNELS = {
    "paged_decode_attention": cpu_kernel_available,
    "quant_linear": kernel_available,
    "layer_ops": layer_ops_available,
}


def main() -> int:
    failed = [name for name, available in KERNELS.items() if not available()]
    for name in KERNELS:
        print(f"kernels: {name}: {'missing' if name in failed else 'built'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

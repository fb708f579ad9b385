"""Triton kernel tests: on CPU tensors through the interpreter unless told otherwise.

``TRITON_INTERPRET=1`` must be set before triton is imported (``@triton.jit`` reads it when
a kernel is defined), and this conftest is loaded before the test modules that import the
kernels. An explicit ``TRITON_INTERPRET=0`` keeps the compiler: then the same small-shape
tests run on the GPU (``device`` is cuda), and the ``gpu``-marked real-shape tests run too.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.triton.checks import interpreting


@pytest.fixture
def device() -> torch.device:
    """Where the small-shape tests put their tensors: the CPU under the interpreter."""
    if interpreting():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 compiles the kernels, which needs CUDA")
    return torch.device("cuda")

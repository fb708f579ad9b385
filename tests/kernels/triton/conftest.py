"""Triton kernel tests: on CPU tensors through the interpreter where there is no CUDA, on
the GPU where there is, unless ``TRITON_INTERPRET`` says otherwise.

``TRITON_INTERPRET`` must be set before triton is imported (``@triton.jit`` reads it when a
kernel is defined), and this conftest is loaded before the test modules that import the
kernels. Compiled (``TRITON_INTERPRET=0``, the default with CUDA), the small-shape tests run
on the GPU (``device`` is cuda) and the ``gpu``-marked real-shape tests run too; the
engine's CPU run of its GPU path (``test_engine_path.py``) needs the interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch

# Where CUDA exists the kernels compile for it (so `pytest -m gpu` runs every GPU test
# without further setting); elsewhere the interpreter runs them on CPU tensors.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

from kernels.triton.checks import interpreting


@pytest.fixture
def device() -> torch.device:
    """Where the small-shape tests put their tensors: the CPU under the interpreter."""
    if interpreting():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 compiles the kernels, which needs CUDA")
    return torch.device("cuda")

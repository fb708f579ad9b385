"""Where an engine computes: the device and dtype behind ``--device`` and ``--dtype``.

``auto`` picks CUDA when torch sees a GPU, else the CPU; the dtype's ``auto`` is bfloat16 on
CUDA (what GPU checkpoints ship and tensor cores run) and float32 on the CPU (the exact
path, and the one the compiled CPU kernels take). One engine lives on one device: its
weights, KV pool, batch metadata and sampler all do.
"""

from __future__ import annotations

import torch

from engine.engine_config import DTYPE_NAMES
from engine.errors import InvalidRequestError

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str) -> torch.device:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` as a device this process can use."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise InvalidRequestError(f"device must be one of {list(DEVICES)}, got {name!r}") from exc
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise InvalidRequestError(f"device must be one of {list(DEVICES)}, got {name!r}")
    if not torch.cuda.is_available():
        raise InvalidRequestError(f"device {name!r} asked, but torch sees no CUDA device here")
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise InvalidRequestError(
            f"device {name!r} asked, but torch sees {torch.cuda.device_count()} CUDA device(s)"
        )
    return torch.device("cuda", index)


def resolve_dtype(name: str, device: torch.device) -> str:
    """The dtype's name: ``auto`` is bfloat16 on CUDA and float32 on the CPU."""
    if name == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    if name not in DTYPES:
        raise InvalidRequestError(f"dtype must be one of {['auto', *DTYPES]}, got {name!r}")
    return name

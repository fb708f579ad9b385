"""Rotary position embeddings (Hugging Face Llama convention: rotate_half, not interleaved)."""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig, RopeScaling


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies, with the checkpoint's rope scaling applied."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).double() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    if scaling.kind == "llama3":
        return _llama3(inv, scaling)
    raise ValueError(f"unsupported rope scaling {scaling.kind!r}")


def _llama3(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables for every position up to the model's context."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        # Computed on the CPU in float32 whatever the device, so every device rotates by
        # the same tables (rounded once to ``dtype``).
        inv = inverse_frequencies(config).float()
        pos = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(pos, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)
        self.half = config.head_dim // 2

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin as ``[T, 1, head_dim]`` for broadcasting over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape ``[T, heads, head_dim]``."""
        x1 = x[..., : self.half]
        x2 = x[..., self.half :]
        rotated = torch.cat((-x2, x1), dim=-1)
        return x * cos + rotated * sin

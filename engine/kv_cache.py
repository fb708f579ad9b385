"""The paged KV pool: one tensor that holds every layer's keys and values in fixed-size blocks.

Layout: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (2 = key, value).
Why this order: one layer's keys of one block are a single contiguous byte range, and so is
a run of consecutive block ids. A request's KV for one layer is therefore ``2 x runs`` byte
ranges (``transfer.block_runs_ranges``), which the transfer layer pushes into another process's
pool layer by layer while later layers still compute. The pool may live in memory someone
else owns (a POSIX shared-memory segment the prefill worker writes into): pass that buffer in.

The block manager (``engine/block_manager.py``) owns which block belongs to whom; this module
only owns the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of a KV pool; two pools with equal specs can exchange blocks byte for byte."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def for_model(
        cls, config: ModelConfig, *, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> KVCacheSpec:
        return cls(
            num_layers=config.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=dtype,
        )

    @property
    def shape(self) -> tuple[int, ...]:
        return (
            self.num_layers,
            2,
            self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of keys (or of values) in one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token occupies across all layers (keys and values)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def total_bytes(self) -> int:
        return self.block_bytes * 2 * self.num_layers * self.num_blocks

    def offset(self, layer: int, kv: int, block_id: int) -> int:
        """Byte offset of (layer, key=0/value=1, block) from the start of the pool."""
        return ((layer * 2 + kv) * self.num_blocks + block_id) * self.block_bytes

    @staticmethod
    def blocks_for_bytes(
        config: ModelConfig, nbytes: int, *, block_size: int, dtype: torch.dtype
    ) -> int:
        one = KVCacheSpec.for_model(config, num_blocks=1, block_size=block_size, dtype=dtype)
        return max(0, nbytes // one.total_bytes)


class KVCache:
    """Owns the pool tensor; hands out per-layer views and the flat byte view peers copy from."""

    def __init__(
        self,
        spec: KVCacheSpec,
        buffer: torch.Tensor | None = None,
        *,
        device: torch.device | str = "cpu",
    ) -> None:
        """A pool on ``device``, or in ``buffer`` (which must be on that device)."""
        self.spec = spec
        device = torch.device(device)
        if buffer is None:
            self.pool = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
        else:
            if buffer.device.type != device.type:
                raise ValueError(f"KV buffer is on {buffer.device}, the engine on {device}")
            flat = buffer.view(torch.uint8) if buffer.dtype != torch.uint8 else buffer
            if flat.numel() < spec.total_bytes:
                raise ValueError(
                    f"KV buffer holds {flat.numel()} bytes, the spec needs {spec.total_bytes}"
                )
            self.pool = flat[: spec.total_bytes].view(spec.dtype).view(spec.shape)
        # Per-layer views are made once: the forward pass asks for them 60 times a step.
        self._k = [self.pool[i, 0] for i in range(spec.num_layers)]
        self._v = [self.pool[i, 1] for i in range(spec.num_layers)]

    def keys(self, layer: int) -> torch.Tensor:
        """``[num_blocks, block_size, num_kv_heads, head_dim]`` view of one layer's keys."""
        return self._k[layer]

    def values(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    def as_bytes(self) -> torch.Tensor:
        """The whole pool as a flat uint8 tensor (shares memory)."""
        return self.pool.view(-1).view(torch.uint8)

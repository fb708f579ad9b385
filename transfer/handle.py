"""What a peer needs to write into a registered KV pool: its block layout and its handle.

``KVLayout`` is the transport-neutral twin of ``engine.kv_cache.KVCacheSpec`` (dtype as a
string, so it survives JSON and protobuf). ``MemoryRegionHandle`` names one registered region:
which transport reaches it, where it is (``address``: a shared-memory path, a ``host:port``,
or for RDMA the remote address plus connection info), how long it is, the secret ``key`` a
writer must present (for RDMA: the rkey), and the layout of the pool inside it. Handles cross
process boundaries as ``to_dict()`` JSON; ``from_dict`` checks every field and raises
``TransferError`` naming the first bad one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from engine.kv_cache import KVCacheSpec
from transfer.errors import IncompatibleLayoutError, TransferError

# dtypes a KV pool may use; names are torch attribute names.
KV_DTYPES: frozenset[str] = frozenset(
    {"float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"}
)


def _require_int(where: str, name: str, value: object, *, minimum: int) -> int:
    # bool is an int subclass; a JSON `true` for a length is garbage, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TransferError(f"{where}: {name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise TransferError(f"{where}: {name} must be >= {minimum}, got {value}")
    return value


def _require_str(where: str, name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise TransferError(f"{where}: {name} must be a non-empty string, got {value!r}")
    return value


def _mapping(where: str, data: object, required: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise TransferError(f"{where}: expected a mapping, got {type(data).__name__}")
    missing = [name for name in required if name not in data]
    if missing:
        raise TransferError(f"{where}: missing field(s) {', '.join(missing)}")
    return data


@dataclass(frozen=True)
class KVLayout:
    """Shape of a KV pool laid out as ``[num_layers, 2, num_blocks, block_size, heads, dim]``.

    Two layouts that differ only in ``num_blocks`` exchange blocks byte for byte.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            _require_int("KV layout", name, getattr(self, name), minimum=1)
        if self.dtype not in KV_DTYPES:
            raise TransferError(
                f"KV layout: dtype must be one of {', '.join(sorted(KV_DTYPES))}, "
                f"got {self.dtype!r}"
            )

    @classmethod
    def from_spec(cls, spec: KVCacheSpec) -> KVLayout:
        return cls(
            num_layers=spec.num_layers,
            num_blocks=spec.num_blocks,
            block_size=spec.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            dtype=str(spec.dtype).removeprefix("torch."),
        )

    def to_spec(self) -> KVCacheSpec:
        return KVCacheSpec(
            num_layers=self.num_layers,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.torch_dtype,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @cached_property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @cached_property
    def block_bytes(self) -> int:
        """Bytes of one block of keys (or of values) in one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @cached_property
    def total_bytes(self) -> int:
        return self.block_bytes * 2 * self.num_layers * self.num_blocks

    def offset(self, layer: int, kv: int, block_id: int) -> int:
        """Byte offset of (layer, key=0/value=1, block); equal to ``KVCacheSpec.offset``."""
        return ((layer * 2 + kv) * self.num_blocks + block_id) * self.block_bytes

    def check_compatible(self, other: KVLayout) -> None:
        """Raise ``IncompatibleLayoutError`` unless blocks of ``other`` match ours byte for byte."""
        if (
            self.num_layers == other.num_layers
            and self.block_size == other.block_size
            and self.num_kv_heads == other.num_kv_heads
            and self.head_dim == other.head_dim
            and self.dtype == other.dtype
        ):
            return
        fields = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype")
        diffs = [
            f"{name} {getattr(self, name)!r} != {getattr(other, name)!r}"
            for name in fields
            if getattr(self, name) != getattr(other, name)
        ]
        if diffs:
            raise IncompatibleLayoutError(f"KV layouts differ: {'; '.join(diffs)}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
        }

    @classmethod
    def from_dict(cls, data: object) -> KVLayout:
        names = ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "dtype")
        fields = _mapping("KV layout", data, names)
        return cls(**{name: fields[name] for name in names})


@dataclass(frozen=True)
class MemoryRegionHandle:
    """Everything a writer needs to put bytes into one registered region, and nothing more.

    ``key`` is a per-region secret (RDMA: the rkey); it is left out of ``repr`` so handles can
    be logged. ``length`` covers at least ``layout.total_bytes``; the pool starts at offset 0.
    """

    transport: str
    address: str
    length: int
    key: str = field(repr=False)
    layout: KVLayout
    region_id: str

    def __post_init__(self) -> None:
        where = "memory-region handle"
        _require_str(where, "transport", self.transport)
        _require_str(where, "address", self.address)
        _require_str(where, "key", self.key)
        _require_str(where, "region_id", self.region_id)
        if not isinstance(self.layout, KVLayout):
            raise TransferError(f"{where}: layout must be a KVLayout")
        _require_int(where, "length", self.length, minimum=self.layout.total_bytes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (str/int values only); ``from_dict`` inverts it exactly."""
        return {
            "transport": self.transport,
            "address": self.address,
            "length": self.length,
            "key": self.key,
            "layout": self.layout.to_dict(),
            "region_id": self.region_id,
        }

    @classmethod
    def from_dict(cls, data: object) -> MemoryRegionHandle:
        """Parse and validate; unknown extra fields are ignored (newer peers may add some)."""
        names = ("transport", "address", "length", "key", "layout", "region_id")
        fields = _mapping("memory-region handle", data, names)
        return cls(
            transport=fields["transport"],
            address=fields["address"],
            length=fields["length"],
            key=fields["key"],
            layout=KVLayout.from_dict(fields["layout"]),
            region_id=fields["region_id"],
        )

"""How one full KV block is named and laid out as a store object.

A key names everything that decides a block's bytes, so two models, two layouts, two
dtypes or two ways of computing never share an entry::

    pdserve/kv1/<model digest>/<layers>x<block size>x<kv heads>x<head dim>/<dtype>/<recipe>/<hash>

``<recipe>`` is ``default`` or ``batch-invariant`` (``engine.model``): the two compute the
same tokens' KV with different last bits, and a batch-invariant worker that loaded a default
one's block would no longer continue a migrated stream exactly.

``<hash>`` is the block's chained content hash (``engine.block_hash``): the whole token prefix
up to and including the block. ``<model digest>`` is ``engine.checkpoint.model_digest``.

An object is a 32-byte header and the block's KV, every layer's keys then values::

    header:  magic b"PDKV" | version u32 | layout digest u64 | block hash u64 | payload u64
    payload: for layer in 0..L-1, for k/v: the block's [block_size, kv_heads, head_dim]

The header repeats what the key says: a load checks it (and the object's size) before any
of its bytes enter a pool, so an object stored under the wrong key, truncated, or of another
layout is refused, never used.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from engine.kv_cache import KVCacheSpec

MAGIC = b"PDKV"
VERSION = 1
_HEADER = struct.Struct("<4sIQQQ")
HEADER_BYTES = _HEADER.size  # 32


class BlockMismatch(Exception):
    """An object's header or size is not the block its key names."""


@dataclass(frozen=True)
class BlockFormat:
    """The store objects of one engine's blocks: their keys, size and header."""

    model_digest: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without "torch.", e.g. "float16"
    itemsize: int
    recipe: str = "default"  # or "batch-invariant": how the engine computed the KV

    @classmethod
    def for_pool(
        cls, spec: KVCacheSpec, model_digest: str, *, batch_invariant: bool = False
    ) -> BlockFormat:
        return cls(
            model_digest=model_digest,
            num_layers=spec.num_layers,
            block_size=spec.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            dtype=str(spec.dtype).removeprefix("torch."),
            itemsize=spec.itemsize,
            recipe="batch-invariant" if batch_invariant else "default",
        )

    @property
    def prefix(self) -> str:
        """Every key of this format starts with it (one model, layout, dtype and recipe)."""
        shape = f"{self.num_layers}x{self.block_size}x{self.num_kv_heads}x{self.head_dim}"
        return f"pdserve/kv{VERSION}/{self.model_digest}/{shape}/{self.dtype}/{self.recipe}/"

    def key(self, block_hash: int) -> str:
        return f"{self.prefix}{block_hash:016x}"

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's keys (or values) of one block."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def payload_bytes(self) -> int:
        return 2 * self.num_layers * self.layer_bytes

    @property
    def object_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes

    @property
    def layout_digest(self) -> int:
        """64 bits naming the prefix (model, layout, dtype, recipe), for the header."""
        digest = hashlib.blake2b(self.prefix.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    def header(self, block_hash: int) -> bytes:
        return _HEADER.pack(MAGIC, VERSION, self.layout_digest, block_hash, self.payload_bytes)

    def check(self, header: bytes, block_hash: int, size: int) -> None:
        """Raise ``BlockMismatch`` unless an object of ``size`` bytes starting with
        ``header`` is block ``block_hash`` of this format."""
        if size != self.object_bytes:
            raise BlockMismatch(f"object is {size} bytes, a block is {self.object_bytes}")
        magic, version, layout, found, payload = _HEADER.unpack(header[:HEADER_BYTES])
        if magic != MAGIC or version != VERSION:
            raise BlockMismatch(f"not a pdserve KV block (magic {magic!r}, version {version})")
        if layout != self.layout_digest:
            raise BlockMismatch("block of another model, layout, dtype or recipe")
        if found != block_hash:
            raise BlockMismatch(f"block {found:016x} stored under the key of {block_hash:016x}")
        if payload != self.payload_bytes:
            raise BlockMismatch(f"payload of {payload} bytes, a block has {self.payload_bytes}")

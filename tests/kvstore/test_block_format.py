"""A block's key and header name its model, layout, dtype and hash; a load refuses an
object that is not the block its key names."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.kv_cache import KVCacheSpec
from kvstore.block_format import HEADER_BYTES, BlockFormat, BlockMismatch

SPEC = KVCacheSpec(num_layers=2, num_blocks=4, block_size=16, num_kv_heads=3, head_dim=8,
                   dtype=torch.float16)  # fmt: skip


def _fmt(**changes: object) -> BlockFormat:
    fmt = BlockFormat.for_pool(SPEC, "0123456789abcdef")
    return dataclasses.replace(fmt, **changes)  # type: ignore[arg-type]


def test_keys_name_model_layout_dtype_recipe_and_hash() -> None:
    fmt = _fmt()
    assert fmt.key(0xAB) == "pdserve/kv1/0123456789abcdef/2x16x3x8/float16/default/00000000000000ab"
    invariant = BlockFormat.for_pool(SPEC, "0123456789abcdef", batch_invariant=True)
    assert invariant.key(0xAB).endswith("/float16/batch-invariant/00000000000000ab")
    others = [_fmt(model_digest="f" * 16), _fmt(block_size=32), _fmt(num_layers=3),
              _fmt(dtype="float32", itemsize=4), _fmt(head_dim=16), invariant]  # fmt: skip
    assert len({fmt.key(1), *(o.key(1) for o in others)}) == 7
    assert fmt.key(1) != fmt.key(2)
    # a block of the other recipe under this recipe's key is refused by its header
    with pytest.raises(BlockMismatch, match="another model"):
        fmt.check(invariant.header(7), 7, fmt.object_bytes)


def test_an_object_is_a_header_and_every_layers_keys_and_values() -> None:
    fmt = _fmt()
    assert fmt.layer_bytes == 16 * 3 * 8 * 2
    assert fmt.object_bytes == HEADER_BYTES + 2 * 2 * fmt.layer_bytes
    fmt.check(fmt.header(7), 7, fmt.object_bytes)


@pytest.mark.parametrize(
    ("header_of", "size_delta", "why"),
    [
        (lambda f: f.header(8), 0, "stored under the key of"),
        (lambda f: _fmt(model_digest="f" * 16).header(7), 0, "another model"),
        (lambda f: _fmt(block_size=32).header(7), 0, "another model"),
        (lambda f: f.header(7), -1, "bytes, a block is"),
        (lambda f: b"XXXX" + f.header(7)[4:], 0, "not a pdserve KV block"),
        (lambda f: bytes(HEADER_BYTES), 0, "not a pdserve KV block"),
    ],
)
def test_a_wrong_object_is_refused(header_of, size_delta: int, why: str) -> None:
    fmt = _fmt()
    with pytest.raises(BlockMismatch, match=why):
        fmt.check(header_of(fmt), 7, fmt.object_bytes + size_delta)

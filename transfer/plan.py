"""Which bytes of one layer move where: a request's block ids on both sides -> byte ranges.

A request's KV for one layer is its keys then its values; each is one range per run of block
ids that are consecutive on *both* sides (the block manager hands out consecutive ids when it
can, so a fresh request is usually two ranges per layer).
"""

from __future__ import annotations

from collections.abc import Sequence

from transfer.errors import TransferError
from transfer.handle import KVLayout

ByteRange = tuple[int, int, int]
"""``(src_offset, dst_offset, length)`` in bytes."""


def _check_ids(side: str, block_ids: Sequence[int], num_blocks: int) -> None:
    for block_id in block_ids:
        if not isinstance(block_id, int) or isinstance(block_id, bool):
            raise TransferError(f"{side} block id {block_id!r} is not an int")
        if not 0 <= block_id < num_blocks:
            raise TransferError(f"{side} block id {block_id} outside [0, {num_blocks})")


def plan_ranges(
    src_layout: KVLayout,
    dst_layout: KVLayout,
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    layer: int,
) -> list[ByteRange]:
    """Byte ranges that copy ``src_block_ids[i]`` to ``dst_block_ids[i]`` for one layer.

    Keys come first, then values; runs consecutive on both sides merge into one range.
    Raises ``IncompatibleLayoutError`` when the layouts cannot exchange blocks and
    ``TransferError`` for unequal id lists, ids outside either pool, or a bad layer.
    """
    src_layout.check_compatible(dst_layout)
    if len(src_block_ids) != len(dst_block_ids):
        raise TransferError(
            f"{len(src_block_ids)} source blocks but {len(dst_block_ids)} destination blocks"
        )
    if not isinstance(layer, int) or not 0 <= layer < src_layout.num_layers:
        raise TransferError(f"layer {layer!r} outside [0, {src_layout.num_layers})")
    _check_ids("source", src_block_ids, src_layout.num_blocks)
    _check_ids("destination", dst_block_ids, dst_layout.num_blocks)

    runs: list[tuple[int, int, int]] = []  # (src_start, dst_start, blocks)
    for src_id, dst_id in zip(src_block_ids, dst_block_ids, strict=True):
        if runs:
            src_start, dst_start, count = runs[-1]
            if src_id == src_start + count and dst_id == dst_start + count:
                runs[-1] = (src_start, dst_start, count + 1)
                continue
        runs.append((src_id, dst_id, 1))

    block_bytes = src_layout.block_bytes
    return [
        (
            src_layout.offset(layer, kv, src_start),
            dst_layout.offset(layer, kv, dst_start),
            count * block_bytes,
        )
        for kv in (0, 1)
        for src_start, dst_start, count in runs
    ]

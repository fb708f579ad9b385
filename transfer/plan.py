"""Which bytes of one layer move where: a request's block ids on both sides -> byte ranges.

A request's KV for one layer is its keys then its values; each is one range per run of block
ids that are consecutive on *both* sides (the block manager hands out consecutive ids when it
can, so a fresh request is usually two ranges per layer). The runs are the same in every
layer: ``plan_blocks`` finds them once per request (a ``BlockPlan``), ``BlockPlan.ranges``
gives any layer's ranges, and a transport can copy one run of many layers in one strided
call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

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


@dataclass(frozen=True)
class BlockPlan:
    """One request's block runs between two pools; the same in every layer.

    ``runs`` are ``(src_offset, dst_offset, length)`` in bytes *within one row* of each
    pool, a row being one layer's keys (or values): ``num_blocks * block_bytes`` bytes. A
    layer's keys of a run sit at ``layer * 2 * row + offset``, its values one row further.
    Runs are the request's block ids consecutive on both sides, in request order.
    """

    src_layout: KVLayout
    dst_layout: KVLayout
    runs: tuple[tuple[int, int, int], ...]

    @cached_property
    def src_row(self) -> int:
        return self.src_layout.num_blocks * self.src_layout.block_bytes

    @cached_property
    def dst_row(self) -> int:
        return self.dst_layout.num_blocks * self.dst_layout.block_bytes

    @cached_property
    def layer_bytes(self) -> int:
        """Bytes one layer moves (keys and values)."""
        return 2 * sum(n for _, _, n in self.runs)

    def ranges(self, layer: int) -> list[ByteRange]:
        """The byte ranges of ``layer``: keys first, then values (``layer`` not checked)."""
        src_row, dst_row = self.src_row, self.dst_row
        out: list[ByteRange] = []
        for kv in (0, 1):
            s0, d0 = (2 * layer + kv) * src_row, (2 * layer + kv) * dst_row
            out.extend((s0 + s, d0 + d, n) for s, d, n in self.runs)
        return out


def plan_blocks(
    src_layout: KVLayout,
    dst_layout: KVLayout,
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
) -> BlockPlan:
    """The runs that copy ``src_block_ids[i]`` to ``dst_block_ids[i]`` in every layer.

    Raises ``IncompatibleLayoutError`` when the layouts cannot exchange blocks and
    ``TransferError`` for unequal id lists or ids outside either pool.
    """
    src_layout.check_compatible(dst_layout)
    if len(src_block_ids) != len(dst_block_ids):
        raise TransferError(
            f"{len(src_block_ids)} source blocks but {len(dst_block_ids)} destination blocks"
        )
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
    return BlockPlan(
        src_layout,
        dst_layout,
        tuple((s * block_bytes, d * block_bytes, count * block_bytes) for s, d, count in runs),
    )


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
    plan = plan_blocks(src_layout, dst_layout, src_block_ids, dst_block_ids)
    check_layer(layer, src_layout.num_layers)
    return plan.ranges(layer)


def check_layer(layer: object, num_layers: int) -> None:
    """``TransferError`` unless ``layer`` is an int in ``[0, num_layers)``."""
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < num_layers:
        raise TransferError(f"layer {layer!r} outside [0, {num_layers})")

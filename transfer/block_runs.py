"""Which bytes of a request move where: block ids on both sides -> byte runs.

A request's KV in one layer is its keys, then its values; each is one byte range per run of
block ids that are consecutive on *both* sides (the block manager hands out consecutive ids
when it can, so a fresh request is usually one run). The runs are the same in every layer,
so a job plans them once (``block_runs``) and any layer's ranges follow from them
(``BlockRuns.ranges``); a transport may also copy one run of many layers in one strided call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from transfer.errors import TransferError
from transfer.handle import KVLayout

ByteRange = tuple[int, int, int]
"""``(src_offset, dst_offset, length)`` in bytes."""


@dataclass(frozen=True)
class BlockRuns:
    """One request's block runs between two pools.

    ``runs`` are ``(src_offset, dst_offset, length)`` in bytes *within one row* of each pool,
    a row being one layer's keys (or values): ``src_row`` / ``dst_row`` bytes. A layer's keys
    of a run sit at ``2 * layer * row + offset``, its values one row further.
    """

    src_layout: KVLayout
    dst_layout: KVLayout
    runs: tuple[ByteRange, ...]

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

    @property
    def num_layers(self) -> int:
        return self.src_layout.num_layers

    def ranges(self, layer: int) -> list[ByteRange]:
        """The byte ranges of ``layer`` in the two flat pools: keys first, then values."""
        out: list[ByteRange] = []
        for kv in (0, 1):
            src_base = (2 * layer + kv) * self.src_row
            dst_base = (2 * layer + kv) * self.dst_row
            out.extend((src_base + s, dst_base + d, n) for s, d, n in self.runs)
        return out


def _check_ids(side: str, block_ids: Sequence[int], num_blocks: int) -> None:
    for block_id in block_ids:
        if not isinstance(block_id, int) or isinstance(block_id, bool):
            raise TransferError(f"{side} block id {block_id!r} is not an int")
        if not 0 <= block_id < num_blocks:
            raise TransferError(f"{side} block id {block_id} outside [0, {num_blocks})")


def first_repeat(block_ids: Sequence[int]) -> int | None:
    """The first id that ``block_ids`` names a second time, or None."""
    seen: set[int] = set()
    for block_id in block_ids:
        if block_id in seen:
            return block_id
        seen.add(block_id)
    return None


def block_runs(
    src_layout: KVLayout,
    dst_layout: KVLayout,
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
) -> BlockRuns:
    """The runs that copy ``src_block_ids[i]`` to ``dst_block_ids[i]`` in every layer.

    Raises ``IncompatibleLayoutError`` when the layouts cannot exchange blocks and
    ``TransferError`` for unequal id lists, ids outside either pool, or a destination id
    named twice.
    """
    src_layout.check_compatible(dst_layout)
    if len(src_block_ids) != len(dst_block_ids):
        raise TransferError(
            f"{len(src_block_ids)} source blocks but {len(dst_block_ids)} destination blocks"
        )
    _check_ids("source", src_block_ids, src_layout.num_blocks)
    _check_ids("destination", dst_block_ids, dst_layout.num_blocks)
    twice = first_repeat(dst_block_ids)
    if twice is not None:
        raise TransferError(f"destination block {twice} named twice: two would race into it")
    runs: list[tuple[int, int, int]] = []  # (first src id, first dst id, blocks)
    for s, d in zip(src_block_ids, dst_block_ids, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    size = src_layout.block_bytes
    return BlockRuns(
        src_layout, dst_layout, tuple((s * size, d * size, n * size) for s, d, n in runs)
    )


def layer_ranges(
    src_layout: KVLayout,
    dst_layout: KVLayout,
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    layer: int,
) -> list[ByteRange]:
    """Byte ranges that copy ``src_block_ids[i]`` to ``dst_block_ids[i]`` for one layer
    (``block_runs``, then that layer's ranges); ``TransferError`` for a bad layer too."""
    runs = block_runs(src_layout, dst_layout, src_block_ids, dst_block_ids)
    check_layer(layer, src_layout.num_layers)
    return runs.ranges(layer)


def check_layer(layer: object, num_layers: int) -> None:
    """``TransferError`` unless ``layer`` is an int in ``[0, num_layers)``."""
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < num_layers:
        raise TransferError(f"layer {layer!r} outside [0, {num_layers})")

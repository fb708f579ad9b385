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

from transfer.errors import TransferError
from transfer.handle import KVLayout

ByteRange = tuple[int, int, int]
"""``(src_offset, dst_offset, length)`` in bytes."""


_INT = {int}


def _check_ids(side: str, block_ids: Sequence[int], num_blocks: int) -> None:
    if not block_ids or (
        set(map(type, block_ids)) == _INT and min(block_ids) >= 0 and max(block_ids) < num_blocks
    ):
        return  # the common case, checked without a Python-level loop
    for block_id in block_ids:
        if not isinstance(block_id, int) or isinstance(block_id, bool):
            raise TransferError(f"{side} block id {block_id!r} is not an int")
        if not 0 <= block_id < num_blocks:
            raise TransferError(f"{side} block id {block_id} outside [0, {num_blocks})")


class BlockPlan:
    """One request's block runs between two pools; the same in every layer.

    ``runs`` are ``(src_offset, dst_offset, length)`` in bytes *within one row* of each
    pool, a row being one layer's keys (or values): ``num_blocks * block_bytes`` bytes
    (``src_row``, ``dst_row``). A layer's keys of a run sit at ``layer * 2 * row + offset``,
    its values one row further. Runs are the request's block ids consecutive on both sides,
    in request order. ``layer_bytes``: bytes one layer moves (keys and values).

    Immutable by convention; a plain class with slots, every field computed here, because
    every request makes one on its first layer's path (``plan_blocks``).
    """

    __slots__ = ("dst_layout", "dst_row", "layer_bytes", "runs", "src_layout", "src_row")

    def __init__(
        self, src_layout: KVLayout, dst_layout: KVLayout, runs: tuple[tuple[int, int, int], ...]
    ) -> None:
        self.src_layout = src_layout
        self.dst_layout = dst_layout
        self.runs = runs
        self.src_row = src_layout.num_blocks * src_layout.block_bytes
        self.dst_row = dst_layout.num_blocks * dst_layout.block_bytes
        run_bytes = 0
        for run in runs:  # a loop, not a comprehension: no function call, on every request
            run_bytes += run[2]
        self.layer_bytes = 2 * run_bytes

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockPlan):
            return NotImplemented
        return (self.src_layout, self.dst_layout, self.runs) == (
            other.src_layout,
            other.dst_layout,
            other.runs,
        )

    def __hash__(self) -> int:
        return hash((self.src_layout, self.dst_layout, self.runs))

    def __repr__(self) -> str:
        return f"BlockPlan(runs={self.runs!r})"

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
    if src_layout is not dst_layout:
        src_layout.check_compatible(dst_layout)
    count = len(src_block_ids)
    if count != len(dst_block_ids):
        raise TransferError(f"{count} source blocks but {len(dst_block_ids)} destination blocks")
    if not count:
        return BlockPlan(src_layout, dst_layout, ())
    if set(map(type, src_block_ids)) != _INT or set(map(type, dst_block_ids)) != _INT:
        _check_ids("source", src_block_ids, src_layout.num_blocks)  # raises, naming the id
        _check_ids("destination", dst_block_ids, dst_layout.num_blocks)
    # Runs in block ids: a run ends where either side's next id is not the next block.
    # Every id lies between its run's first and last, so checking a run's bounds checks
    # every id in it.
    blocks: list[tuple[int, int, int]] = []
    s0, d0, n = src_block_ids[0], dst_block_ids[0], 0
    for s, d in zip(src_block_ids, dst_block_ids, strict=True):
        if s == s0 + n and d == d0 + n:
            n += 1
        else:
            blocks.append((s0, d0, n))
            s0, d0, n = s, d, 1
    blocks.append((s0, d0, n))
    src_limit, dst_limit = src_layout.num_blocks, dst_layout.num_blocks
    size = src_layout.block_bytes
    runs: list[tuple[int, int, int]] = []
    for s, d, n in blocks:
        if s < 0 or d < 0 or s + n > src_limit or d + n > dst_limit:
            _check_ids("source", src_block_ids, src_limit)  # raises, naming the id
            _check_ids("destination", dst_block_ids, dst_limit)
        runs.append((s * size, d * size, n * size))
    return BlockPlan(src_layout, dst_layout, tuple(runs))


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

"""block_runs / layer_ranges: block ids on both sides -> merged byte runs, keys then values."""

from __future__ import annotations

import pytest
import torch

from transfer import IncompatibleLayoutError, KVLayout, TransferError, layer_ranges
from transfer.block_runs import block_runs

SRC = KVLayout(
    num_layers=4, num_blocks=16, block_size=2, num_kv_heads=1, head_dim=4, dtype="float32"
)
DST = KVLayout(
    num_layers=4, num_blocks=10, block_size=2, num_kv_heads=1, head_dim=4, dtype="float32"
)
B = SRC.block_bytes  # 32


def test_consecutive_on_both_sides_merge_into_one_range_per_kv() -> None:
    ranges = layer_ranges(SRC, DST, [4, 5, 6], [1, 2, 3], layer=0)
    assert ranges == [(4 * B, 1 * B, 3 * B), ((16 + 4) * B, (10 + 1) * B, 3 * B)]


def test_runs_break_where_either_side_breaks() -> None:
    # src consecutive but dst jumps; then dst consecutive but src jumps.
    ranges = layer_ranges(SRC, DST, [0, 1, 2, 7, 9], [5, 6, 0, 1, 2], layer=1)
    base_s, base_d = 2 * 16 * B, 2 * 10 * B  # layer 1 keys
    keys = [
        (base_s + 0 * B, base_d + 5 * B, 2 * B),
        (base_s + 2 * B, base_d + 0 * B, 1 * B),
        (base_s + 7 * B, base_d + 1 * B, 1 * B),
        (base_s + 9 * B, base_d + 2 * B, 1 * B),
    ]
    values = [(s + 16 * B, d + 10 * B, n) for s, d, n in keys]
    assert ranges == keys + values


def test_layer_offsets_follow_the_pool_layout() -> None:
    for layer in range(4):
        (k, v) = layer_ranges(SRC, DST, [3], [8], layer)
        assert k == (SRC.offset(layer, 0, 3), DST.offset(layer, 0, 8), B)
        assert v == (SRC.offset(layer, 1, 3), DST.offset(layer, 1, 8), B)


def test_ranges_move_exactly_the_named_blocks() -> None:
    src = torch.randint(0, 256, (SRC.total_bytes,), dtype=torch.uint8)
    dst = torch.zeros(DST.total_bytes, dtype=torch.uint8)
    src_ids, dst_ids = [15, 3, 4, 5], [9, 0, 1, 7]
    for layer in (0, 3):
        for s, d, n in layer_ranges(SRC, DST, src_ids, dst_ids, layer):
            dst[d : d + n] = src[s : s + n]
    sv = src.view(4, 2, 16, B)
    dv = dst.view(4, 2, 10, B)
    want = torch.zeros_like(dv)
    for layer in (0, 3):
        for s, d in zip(src_ids, dst_ids, strict=True):
            want[layer, :, d] = sv[layer, :, s]
    assert torch.equal(dv, want)


def test_empty_request_gives_no_ranges() -> None:
    assert layer_ranges(SRC, DST, [], [], layer=0) == []


@pytest.mark.parametrize(
    "change",
    [
        {"block_size": 4},
        {"num_kv_heads": 2},
        {"head_dim": 8},
        {"dtype": "bfloat16"},
        {"num_layers": 3},
    ],
)
def test_incompatible_layouts_are_refused(change: dict) -> None:
    other = KVLayout(**{**DST.to_dict(), **change})
    with pytest.raises(IncompatibleLayoutError, match=next(iter(change))):
        layer_ranges(SRC, other, [0], [0], layer=0)


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "layer", "message"),
    [
        ([0, 1], [0], 0, "2 source blocks but 1 destination"),
        ([16], [0], 0, "source block id 16 outside"),
        ([0], [10], 0, "destination block id 10 outside"),
        ([0], [-1], 0, "destination block id -1 outside"),
        # Inside a run of consecutive ids, on either side, at either end of it.
        ([13, 14, 15, 16], [0, 1, 2, 3], 0, "source block id 16 outside"),
        ([0, 1, 2], [-1, 0, 1], 0, "destination block id -1 outside"),
        ([0, 1], [True, 2], 0, "destination block id True is not an int"),
        ([0, 1.0], [1, 2], 0, "source block id 1.0 is not an int"),
        ([0, 1, 2], [4, 6, 4], 0, "destination block 4 named twice"),
        ([0, 1], [3, 3], 0, "destination block 3 named twice"),
        ([0], [0], 4, "layer 4 outside"),
        ([0], [0], -1, "layer -1 outside"),
    ],
)
def test_bad_ids_and_layers_are_refused(
    src_ids: list[int], dst_ids: list[int], layer: int, message: str
) -> None:
    with pytest.raises(TransferError, match=message):
        layer_ranges(SRC, DST, src_ids, dst_ids, layer)


def test_block_plan_gives_every_layers_ranges_from_one_set_of_runs() -> None:
    src_ids, dst_ids = [4, 5, 6, 0, 1, 15], [1, 2, 3, 7, 8, 9]
    plan = block_runs(SRC, DST, src_ids, dst_ids)
    # Runs consecutive on both sides, as byte offsets inside one (layer, keys|values) row.
    assert plan.runs == ((4 * B, 1 * B, 3 * B), (0, 7 * B, 2 * B), (15 * B, 9 * B, B))
    assert (plan.src_row, plan.dst_row) == (16 * B, 10 * B)
    assert plan.layer_bytes == 2 * 6 * B
    for layer in range(SRC.num_layers):
        assert plan.ranges(layer) == layer_ranges(SRC, DST, src_ids, dst_ids, layer)
    with pytest.raises(TransferError, match="source block id 16"):
        block_runs(SRC, DST, [16], [0])

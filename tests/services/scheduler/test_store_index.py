"""The scheduler's index of the blocks each KV store holds: confirmations count until a
miss is reported (no clock), the index is bounded, and only a leading run counts."""

from __future__ import annotations

import pytest

from services.scheduler.store_index import StoreIndex


def test_a_leading_run_of_confirmations_counts_until_a_miss_is_reported() -> None:
    index = StoreIndex()
    index.note("m:1", [1, 2, 3])
    assert index.leading_run("m:1", [1, 2, 3, 4]) == 3
    assert index.leading_run("m:1", [1, 9, 3]) == 1  # a hole ends the run
    assert index.leading_run("m:2", [1, 2]) == 0  # another store
    assert index.forget("m:1", [2, 7]) == 1  # 7 was never listed
    assert index.leading_run("m:1", [1, 2, 3]) == 1  # 2 is missing: 3 is useless
    assert index.forget("m:2", [1]) == 0  # a store nobody confirmed anything in
    index.note("m:1", [2])  # stored again
    assert index.leading_run("m:1", [1, 2, 3]) == 3
    index.note("", [1])  # a worker without a store reports nothing
    assert len(index) == 3


def test_the_bound_drops_the_oldest_confirmation_first() -> None:
    index = StoreIndex(max_blocks=3)
    index.note("m:1", [1, 2])
    index.note("m:1", [3, 4])
    assert len(index) == 3  # 1, the oldest, went first
    assert index.leading_run("m:1", [2, 3, 4]) == 3
    index.note("m:1", [2])  # confirmed again: now the newest
    index.note("m:1", [5])
    assert index.leading_run("m:1", [2, 4, 5]) == 3  # 3 went, not 2
    with pytest.raises(ValueError):
        StoreIndex(max_blocks=0)

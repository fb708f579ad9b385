"""The scheduler's index of the blocks each KV store holds: confirmations expire, the index
is bounded, and only a leading run of a prompt's blocks counts."""

from __future__ import annotations

import pytest

from services.scheduler.store_index import StoreIndex


def test_a_leading_run_of_fresh_confirmations_counts() -> None:
    index = StoreIndex(ttl_s=10.0)
    index.note("m:1", [1, 2, 3], now=100.0)
    assert index.leading_run("m:1", [1, 2, 3, 4], now=105.0) == 3
    assert index.leading_run("m:1", [1, 9, 3], now=105.0) == 1  # a hole ends the run
    assert index.leading_run("m:2", [1, 2], now=105.0) == 0  # another store
    assert index.leading_run("m:1", [1, 2], now=110.5) == 0  # too old to trust
    index.note("m:1", [1], now=110.0)  # confirmed again
    assert index.leading_run("m:1", [1, 2], now=110.5) == 1
    index.note("", [1], now=110.0)  # a worker without a store reports nothing
    assert len(index) == 3


def test_expiry_and_the_bound_drop_the_oldest_first() -> None:
    index = StoreIndex(ttl_s=10.0, max_blocks=3)
    index.note("m:1", [1, 2], now=0.0)
    index.note("m:1", [3, 4], now=5.0)
    assert len(index) == 3  # 1, the oldest, went first
    assert index.leading_run("m:1", [2, 3, 4], now=6.0) == 3
    assert index.expire(now=12.0) == 1  # 2 is 12 s old
    assert index.leading_run("m:1", [3, 4], now=12.0) == 2
    with pytest.raises(ValueError):
        StoreIndex(ttl_s=0)

"""The prefix cache's event log: net deltas, overflow into a snapshot, and agreement with the
block manager that feeds it."""

from __future__ import annotations

import random

import pytest

from engine.block_manager import BlockManager
from engine.cache_events import CacheEventLog


def test_a_drain_gives_the_net_change_since_the_previous_one() -> None:
    log = CacheEventLog()
    assert not log.has_pending and not log.drain()
    log.stored(1)
    log.stored(2)
    log.removed(2)  # stored and gone before anyone looked: reported as removed
    log.removed(3)
    assert log.has_pending
    delta = log.drain()
    assert (sorted(delta.added), sorted(delta.removed), delta.overflowed) == ([1], [2, 3], False)
    assert not log.has_pending and not log.drain()
    log.removed(1)
    log.stored(1)
    assert log.drain().added == (1,)
    assert log.snapshot() == (1,)


def test_overflow_drops_the_delta_and_asks_for_a_snapshot() -> None:
    log = CacheEventLog(max_pending=3)
    for h in range(5):
        log.stored(h)
    delta = log.drain()
    assert delta.overflowed and delta.added == () and delta.removed == ()
    assert sorted(log.snapshot()) == [0, 1, 2, 3, 4]  # the cached set was kept
    assert not log.has_pending
    with pytest.raises(ValueError):
        CacheEventLog(max_pending=0)


def test_a_snapshot_covers_the_pending_change() -> None:
    log = CacheEventLog()
    log.stored(7)
    log.stored(8)
    log.removed(7)
    assert log.snapshot() == (8,)
    assert not log.drain()


def test_the_log_follows_the_block_manager() -> None:
    """Random allocations, commits, frees and resets: a reader that applies every drained
    delta (removed, then added) always holds exactly the block manager's cached hashes."""
    rng = random.Random(7)
    log = CacheEventLog()
    bm = BlockManager(16, 4, events=log)
    reader: set[int] = set()
    owned: list[int] = []
    next_hash = 1000
    for _ in range(2000):
        op = rng.random()
        if op < 0.4 and bm.num_free_blocks:
            owned += bm.allocate(rng.randint(1, min(3, bm.num_free_blocks)))
        elif op < 0.7 and owned:
            block = rng.choice(owned)
            if bm.block_hash_of(block) is None:
                # sometimes a hash another block holds: that block stays the cached one
                known = bm.cached_hashes()
                h = rng.choice(known) if known and rng.random() < 0.2 else next_hash
                next_hash += 1
                bm.commit_full_block(block, h)
        elif op < 0.95 and owned:
            block = owned.pop(rng.randrange(len(owned)))
            bm.free([block])
        elif op >= 0.99:
            bm.reset_prefix_cache()
        if rng.random() < 0.3:
            delta = log.drain()
            reader -= set(delta.removed)
            reader |= set(delta.added)
            assert reader == set(bm.cached_hashes())
    bm.check_invariants()
    assert set(log.snapshot()) == set(bm.cached_hashes())


def test_a_match_claims_no_event() -> None:
    """Reusing a cached block (a prefix hit) changes nothing the scheduler must learn."""
    log = CacheEventLog()
    bm = BlockManager(4, 4, events=log)
    (block,) = bm.allocate(1)
    bm.commit_full_block(block, 42)
    bm.free([block])
    assert log.drain().added == (42,)
    hit = bm.match_prefix([42])
    assert hit.block_ids == (block,)
    assert not log.drain()
    bm.free(list(hit.block_ids))
    bm.allocate(4)  # evicts it
    assert log.drain().removed == (42,)

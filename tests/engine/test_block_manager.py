"""Tests for the paged-KV block manager and the chained block hashes it is keyed by."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_hash import ROOT_HASH, hash_block, hash_blocks
from engine.block_manager import (
    BlockManager,
    BlockStateError,
    NoFreeBlocksError,
    PrefixHit,
    contiguous_runs,
)
from engine.errors import EngineError, InvalidRequestError

REPO_ROOT = Path(__file__).resolve().parents[2]

# Pinned once from this implementation. If these change, every stored or routed hash changes:
# that needs a new personalisation string in engine/block_hash.py, not a new pin.
PINNED_ROOT_HASH = 16854220125074458058
PINNED_HASH_123 = 12710914755421833496  # hash_block(ROOT_HASH, [1, 2, 3])
PINNED_CHAIN_0_TO_39 = [992487407493129837, 14453556212821544611]  # hash_blocks(range(40), 16)


def _snapshot(bm: BlockManager) -> tuple[int, list[int], list[int | None]]:
    blocks = range(bm.num_blocks)
    return (
        bm.num_free_blocks,
        [bm.ref_count(b) for b in blocks],
        [bm.block_hash_of(b) for b in blocks],
    )


# --- block_hash ------------------------------------------------------------------------------


def test_hashes_are_pinned() -> None:
    assert ROOT_HASH == PINNED_ROOT_HASH
    assert hash_block(ROOT_HASH, [1, 2, 3]) == PINNED_HASH_123
    assert hash_blocks(list(range(40)), 16) == PINNED_CHAIN_0_TO_39


@pytest.mark.parametrize("seed", ["0", "4242"])
def test_hashes_are_stable_across_processes(seed: str) -> None:
    code = (
        "from engine.block_hash import ROOT_HASH, hash_block, hash_blocks\n"
        "print(ROOT_HASH, hash_block(ROOT_HASH, [1, 2, 3]), *hash_blocks(list(range(40)), 16))"
    )
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    assert [int(v) for v in out] == [PINNED_ROOT_HASH, PINNED_HASH_123, *PINNED_CHAIN_0_TO_39]


def test_hash_depends_on_parent_order_and_length() -> None:
    h = hash_block(ROOT_HASH, [5, 6])
    assert hash_block(h, [7, 8]) != hash_block(ROOT_HASH, [7, 8])
    assert hash_block(ROOT_HASH, [6, 5]) != h
    assert hash_block(ROOT_HASH, [0]) != hash_block(ROOT_HASH, [0, 0])
    assert hash_block(ROOT_HASH, []) != ROOT_HASH
    assert 0 <= h < 2**64


def test_hash_blocks_chains_and_skips_partial_block() -> None:
    tokens = list(range(10))
    hashes = hash_blocks(tokens, 4)
    assert len(hashes) == 2
    assert hashes[0] == hash_block(ROOT_HASH, [0, 1, 2, 3])
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6, 7])
    assert hash_blocks(tokens[4:], 4, parent=hashes[0]) == hashes[1:]
    assert hash_blocks([1, 2, 3], 4) == []
    # Same tokens in a different first block: every later hash differs too.
    other = hash_blocks([9, *tokens[1:]], 4)
    assert other[0] != hashes[0] and other[1] != hashes[1]


def test_hash_rejects_out_of_range_values() -> None:
    with pytest.raises(InvalidRequestError):
        hash_block(ROOT_HASH, [-1])
    with pytest.raises(InvalidRequestError):
        hash_block(ROOT_HASH, [2**32])
    with pytest.raises(InvalidRequestError):
        hash_block(-1, [1])
    with pytest.raises(InvalidRequestError):
        hash_blocks([1, 2], 0)


# --- contiguous_runs -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ids", "runs"),
    [
        ([], []),
        ([7], [(7, 1)]),
        ([0, 1, 2, 3], [(0, 4)]),
        ([3, 4, 5, 9, 2], [(3, 3), (9, 1), (2, 1)]),
        ([5, 4, 3], [(5, 1), (4, 1), (3, 1)]),
        ([1, 1, 2], [(1, 1), (1, 2)]),
    ],
)
def test_contiguous_runs(ids: list[int], runs: list[tuple[int, int]]) -> None:
    assert contiguous_runs(ids) == runs


# --- BlockManager: allocation and freeing ----------------------------------------------------


def test_fresh_manager_state() -> None:
    bm = BlockManager(8, 4)
    assert (bm.num_blocks, bm.block_size) == (8, 4)
    assert bm.num_free_blocks == 8
    assert bm.usage() == 0.0
    assert all(bm.ref_count(b) == 0 and bm.block_hash_of(b) is None for b in range(8))
    bm.check_invariants()
    with pytest.raises(BlockStateError):
        BlockManager(0)
    with pytest.raises(BlockStateError):
        BlockManager(4, 0)


def test_blocks_needed_and_can_allocate() -> None:
    bm = BlockManager(4, 16)
    assert [bm.blocks_needed(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    assert bm.can_allocate(4) and not bm.can_allocate(5) and bm.can_allocate(0)
    with pytest.raises(BlockStateError):
        bm.blocks_needed(-1)
    with pytest.raises(BlockStateError):
        bm.can_allocate(-1)


def test_allocate_hands_out_low_consecutive_ids() -> None:
    bm = BlockManager(8, 4)
    assert bm.allocate(3) == [0, 1, 2]
    assert bm.allocate(2) == [3, 4]
    assert bm.allocate(0) == []
    assert [bm.ref_count(b) for b in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]
    assert bm.num_free_blocks == 3
    assert bm.usage() == pytest.approx(5 / 8)
    bm.check_invariants()


def test_allocation_failure_leaves_state_unchanged() -> None:
    bm = BlockManager(4, 2)
    table = bm.allocate(2)
    bm.commit_full_block(table[0], hash_block(ROOT_HASH, [1, 2]))
    bm.free(table)
    bm.allocate(1)
    before = _snapshot(bm)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(4)
    assert isinstance(NoFreeBlocksError("x"), EngineError)
    assert _snapshot(bm) == before
    bm.check_invariants()
    with pytest.raises(BlockStateError):
        bm.allocate(-1)


def test_free_returns_blocks_and_unhashed_ones_are_reused_first() -> None:
    bm = BlockManager(8, 4)
    a = bm.allocate(3)
    b = bm.allocate(2)
    bm.free(a)
    assert bm.num_free_blocks == 6
    assert all(bm.ref_count(x) == 0 for x in a)
    # Unhashed freed blocks go to the head, in table order: the same low ids come back.
    assert bm.allocate(3) == [0, 1, 2]
    bm.free(b)
    bm.check_invariants()


def test_double_free_raises_and_changes_nothing() -> None:
    bm = BlockManager(4, 2)
    table = bm.allocate(2)
    bm.free(table)
    before = _snapshot(bm)
    with pytest.raises(BlockStateError, match="double free"):
        bm.free([table[0]])
    assert _snapshot(bm) == before
    live = bm.allocate(2)
    before = _snapshot(bm)
    # One valid decrement followed by one too many: the whole call is rejected.
    with pytest.raises(BlockStateError):
        bm.free([live[0], live[1], live[1]])
    assert _snapshot(bm) == before
    with pytest.raises(BlockStateError):
        bm.free([99])
    with pytest.raises(BlockStateError):
        bm.ref_count(-1)
    assert _snapshot(bm) == before
    bm.check_invariants()


# --- BlockManager: prefix caching ------------------------------------------------------------


def _fill(bm: BlockManager, tokens: list[int]) -> tuple[list[int], list[int]]:
    """Allocate a table for ``tokens`` and commit its full blocks, as the engine will."""
    hashes = hash_blocks(tokens, bm.block_size)
    table = bm.allocate(bm.blocks_needed(len(tokens)))
    for block_id, block_hash in zip(table, hashes, strict=False):
        bm.commit_full_block(block_id, block_hash)
    return table, hashes


def test_prefix_hit_shares_blocks_in_use() -> None:
    bm = BlockManager(8, 2)
    table, hashes = _fill(bm, [1, 2, 3, 4, 5])
    assert [bm.block_hash_of(b) for b in table] == [*hashes, None]
    hit = bm.match_prefix(hash_blocks([1, 2, 3, 4, 9, 9], 2))
    assert hit == PrefixHit(block_ids=(table[0], table[1]), num_tokens=4)
    assert [bm.ref_count(b) for b in table] == [2, 2, 1]
    assert bm.num_free_blocks == 5
    bm.free(hit.block_ids)
    assert [bm.ref_count(b) for b in table] == [1, 1, 1]
    bm.check_invariants()


def test_prefix_hit_stops_at_first_miss() -> None:
    bm = BlockManager(8, 2)
    _, hashes = _fill(bm, [1, 2, 3, 4, 5, 6])
    assert bm.match_prefix([12345, *hashes]) == PrefixHit((), 0)
    assert bm.match_prefix([]) == PrefixHit((), 0)
    hit = bm.match_prefix([hashes[0], 777, hashes[2]])
    assert hit.num_tokens == 2 and len(hit.block_ids) == 1


def test_prefix_hit_revives_freed_blocks() -> None:
    bm = BlockManager(6, 2)
    table, hashes = _fill(bm, [1, 2, 3, 4, 5])
    bm.free(table)
    assert bm.num_free_blocks == 6
    # Freed blocks keep their hashes until reallocated.
    assert [bm.block_hash_of(b) for b in table] == [*hashes, None]
    hit = bm.match_prefix(hash_blocks([1, 2, 3, 4, 5, 6], 2))
    assert hit.block_ids == tuple(table[:2])
    assert [bm.ref_count(b) for b in hit.block_ids] == [1, 1]
    assert bm.num_free_blocks == 4
    assert bm.usage() == pytest.approx(2 / 6)
    bm.check_invariants()


def test_reallocating_a_cached_block_evicts_its_hash() -> None:
    bm = BlockManager(3, 2)
    table, hashes = _fill(bm, [1, 2, 3, 4])
    bm.free(table)
    # Never-used block 2 first, then the chain's last block before its first.
    assert bm.allocate(3) == [2, 1, 0]
    assert all(bm.block_hash_of(b) is None for b in range(3))
    assert bm.match_prefix(hashes) == PrefixHit((), 0)
    bm.check_invariants()


def test_eviction_order_is_lru_with_a_chain_tail_first() -> None:
    bm = BlockManager(5, 1)
    first, first_hashes = _fill(bm, [10, 11])  # blocks 0, 1
    second, second_hashes = _fill(bm, [20, 21])  # blocks 2, 3
    bm.free(first)
    bm.free(second)
    # Block 4 was never used: evicting nothing comes first.
    assert bm.allocate(1) == [4]
    # Then the least recently freed chain, its last block before its first.
    assert bm.allocate(1) == [first[1]]
    assert bm.match_prefix(first_hashes).block_ids == (first[0],)
    assert bm.allocate(1) == [second[1]]
    assert bm.match_prefix(second_hashes).block_ids == (second[0],)
    bm.check_invariants()


def test_commit_of_duplicate_hash_keeps_existing_mapping() -> None:
    bm = BlockManager(4, 2)
    (a,), (h,) = _fill(bm, [1, 2])
    (b,) = bm.allocate(1)
    bm.commit_full_block(b, h)
    assert bm.block_hash_of(a) == h
    assert bm.block_hash_of(b) is None
    assert bm.match_prefix([h]).block_ids == (a,)
    # The private copy is freed as an unhashed block; the original is still cached.
    bm.free([b])
    bm.free([a, a])
    assert bm.match_prefix([h]).block_ids == (a,)
    bm.check_invariants()


def test_commit_contract() -> None:
    bm = BlockManager(4, 2)
    (a,), (h,) = _fill(bm, [1, 2])
    bm.commit_full_block(a, h)  # same hash again: no-op
    assert bm.block_hash_of(a) == h
    with pytest.raises(BlockStateError):
        bm.commit_full_block(a, h + 1)
    with pytest.raises(BlockStateError):
        bm.commit_full_block(3, h + 1)  # block 3 is free
    with pytest.raises(BlockStateError):
        bm.commit_full_block(4, h + 1)  # no such block
    assert bm.block_hash_of(a) == h and bm.block_hash_of(3) is None
    bm.check_invariants()


def test_reset_prefix_cache_forgets_only_free_blocks() -> None:
    bm = BlockManager(6, 2)
    kept, kept_hashes = _fill(bm, [1, 2, 3, 4])
    gone, gone_hashes = _fill(bm, [5, 6, 7, 8])
    bm.free(gone)
    bm.reset_prefix_cache()
    assert [bm.block_hash_of(b) for b in kept] == kept_hashes
    assert all(bm.block_hash_of(b) is None for b in gone)
    assert bm.match_prefix(gone_hashes) == PrefixHit((), 0)
    assert bm.match_prefix(kept_hashes).block_ids == tuple(kept)
    assert [bm.ref_count(b) for b in kept] == [2, 2]
    assert bm.num_free_blocks == 4  # the two reset blocks plus two never used
    bm.check_invariants()


def test_disabled_prefix_caching_never_hits() -> None:
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    table, hashes = _fill(bm, [1, 2, 3, 4])
    assert all(bm.block_hash_of(b) is None for b in table)
    assert bm.match_prefix(hashes) == PrefixHit((), 0)
    bm.free(table)
    assert bm.match_prefix(hashes) == PrefixHit((), 0)
    assert bm.num_free_blocks == 4
    with pytest.raises(BlockStateError):
        bm.commit_full_block(0, hashes[0])  # still must be owned
    bm.check_invariants()


def test_check_invariants_detects_corruption() -> None:
    bm = BlockManager(4, 2)
    bm.allocate(1)
    bm._ref_counts[0] = 0  # free queue no longer matches ref counts
    with pytest.raises(AssertionError, match="free queue"):
        bm.check_invariants()


def test_scales_to_100k_blocks() -> None:
    n = 100_000
    bm = BlockManager(n, 16)
    tokens = list(range(n * 16 // 2))
    table, hashes = _fill(bm, tokens)
    assert len(table) == n // 2 and table[:3] == [0, 1, 2]
    bm.free(table)
    hit = bm.match_prefix(hashes)
    assert hit.block_ids == tuple(table) and bm.num_free_blocks == n // 2
    rest = bm.allocate(n - len(table))
    assert bm.num_free_blocks == 0
    bm.free(rest)
    bm.free(hit.block_ids)
    assert contiguous_runs(rest) == [(n // 2, n // 2)]
    bm.check_invariants()


# --- stateful property test ------------------------------------------------------------------


@dataclass
class _Seq:
    tokens: list[int]
    table: list[int]
    committed: int  # leading full blocks already committed (or taken from a prefix hit)
    hashes: list[int] = field(default_factory=list)


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives a BlockManager like an engine would and checks it against a reference model.

    The model tracks live block tables (hence expected ref counts), the hash -> block cache the
    manager should hold, and the full token prefix each cached block was committed with, so a
    prefix hit is checked against real token content and not only against hashes.
    """

    NUM_BLOCKS = 10
    BLOCK_SIZE = 2
    CACHING = True

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(self.NUM_BLOCKS, self.BLOCK_SIZE, enable_prefix_caching=self.CACHING)
        self.seqs: list[_Seq] = []
        self.cache: dict[int, int] = {}  # expected hash -> block
        self.prefix_of: dict[int, tuple[int, ...]] = {}  # cached block -> tokens up to its end

    # -- model helpers

    def _model_refs(self) -> Counter[int]:
        return Counter(b for s in self.seqs for b in s.table)

    def _model_hash_of(self) -> dict[int, int]:
        return {b: h for h, b in self.cache.items()}

    def _take(self, n: int) -> list[int] | None:
        if not self.bm.can_allocate(n):
            before = _snapshot(self.bm)
            with pytest.raises(NoFreeBlocksError):
                self.bm.allocate(n)
            assert _snapshot(self.bm) == before
            return None
        refs = self._model_refs()
        blocks = self.bm.allocate(n)
        assert len(blocks) == len(set(blocks)) == n
        hash_of = self._model_hash_of()
        for b in blocks:
            assert refs[b] == 0, f"block {b} handed out while owned"
            assert self.bm.ref_count(b) == 1 and self.bm.block_hash_of(b) is None
            if b in hash_of:
                del self.cache[hash_of[b]]
                del self.prefix_of[b]
        return blocks

    def _commit(self, seq: _Seq) -> None:
        seq.hashes = hash_blocks(seq.tokens, self.BLOCK_SIZE)
        hash_of = self._model_hash_of()
        for i in range(seq.committed, len(seq.hashes)):
            b, h = seq.table[i], seq.hashes[i]
            self.bm.commit_full_block(b, h)
            if self.CACHING and h not in self.cache and b not in hash_of:
                self.cache[h] = b
                self.prefix_of[b] = tuple(seq.tokens[: (i + 1) * self.BLOCK_SIZE])
                hash_of[b] = h
            assert self.bm.block_hash_of(b) == hash_of.get(b)
        seq.committed = len(seq.hashes)

    # -- rules

    @rule(
        prompt=st.lists(st.integers(0, 2), max_size=9),
        commit=st.booleans(),
    )
    def add_sequence(self, prompt: list[int], commit: bool) -> None:
        hashes = hash_blocks(prompt, self.BLOCK_SIZE)
        expected: list[int] = []
        for h in hashes:
            if h not in self.cache:
                break
            expected.append(self.cache[h])
        hit = self.bm.match_prefix(hashes)
        assert list(hit.block_ids) == expected
        assert hit.num_tokens == len(expected) * self.BLOCK_SIZE
        for i, b in enumerate(hit.block_ids):
            assert self.prefix_of[b] == tuple(prompt[: (i + 1) * self.BLOCK_SIZE])
        need = self.bm.blocks_needed(len(prompt)) - len(hit.block_ids)
        blocks = self._take(need)
        if blocks is None:
            self.bm.free(hit.block_ids)  # the engine rolls a failed admission back
            return
        seq = _Seq(list(prompt), [*hit.block_ids, *blocks], committed=len(hit.block_ids))
        self.seqs.append(seq)
        if commit:
            self._commit(seq)

    @precondition(lambda self: self.seqs)
    @rule(
        index=st.integers(0, 1000),
        tokens=st.lists(st.integers(0, 2), min_size=1, max_size=4),
        commit=st.booleans(),
    )
    def append_tokens(self, index: int, tokens: list[int], commit: bool) -> None:
        seq = self.seqs[index % len(self.seqs)]
        need = self.bm.blocks_needed(len(seq.tokens) + len(tokens)) - len(seq.table)
        blocks = self._take(need)
        if blocks is None:
            return
        seq.tokens.extend(tokens)
        seq.table.extend(blocks)
        if commit:
            self._commit(seq)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 1000))
    def commit_sequence(self, index: int) -> None:
        self._commit(self.seqs[index % len(self.seqs)])

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 1000))
    def free_sequence(self, index: int) -> None:
        seq = self.seqs.pop(index % len(self.seqs))
        self.bm.free(seq.table)

    @rule()
    def reset_prefix_cache(self) -> None:
        self.bm.reset_prefix_cache()
        refs = self._model_refs()
        for h, b in list(self.cache.items()):
            if refs[b] == 0:
                del self.cache[h]
                del self.prefix_of[b]

    @rule(index=st.integers(0, 1000))
    def double_free_is_rejected(self, index: int) -> None:
        refs = self._model_refs()
        block = index % self.NUM_BLOCKS
        extra = [block] * (refs[block] + 1)
        before = _snapshot(self.bm)
        with pytest.raises(BlockStateError):
            self.bm.free(extra)
        assert _snapshot(self.bm) == before

    @rule()
    def over_allocation_is_rejected(self) -> None:
        assert self._take(self.bm.num_free_blocks + 1) is None

    # -- invariants

    @invariant()
    def manager_is_consistent(self) -> None:
        self.bm.check_invariants()

    @invariant()
    def ref_counts_match_live_tables(self) -> None:
        refs = self._model_refs()
        for s in self.seqs:
            assert len(set(s.table)) == len(s.table), "a table holds a block twice"
            assert len(s.table) == self.bm.blocks_needed(len(s.tokens))
        actual = [self.bm.ref_count(b) for b in range(self.NUM_BLOCKS)]
        assert actual == [refs[b] for b in range(self.NUM_BLOCKS)]
        in_use = sum(1 for c in actual if c > 0)
        assert self.bm.num_free_blocks + in_use == self.NUM_BLOCKS
        assert self.bm.usage() == pytest.approx(in_use / self.NUM_BLOCKS)

    @invariant()
    def hash_mapping_matches_model(self) -> None:
        hash_of = self._model_hash_of()
        for b in range(self.NUM_BLOCKS):
            assert self.bm.block_hash_of(b) == hash_of.get(b)
        for b, prefix in self.prefix_of.items():
            # The hash a block is cached under is the chain hash of the tokens it was filled with.
            assert hash_blocks(prefix, self.BLOCK_SIZE)[-1] == hash_of[b]
        if not self.CACHING:
            assert not self.cache


class BlockManagerNoCachingMachine(BlockManagerMachine):
    CACHING = False


_STATEFUL_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = _STATEFUL_SETTINGS
TestBlockManagerNoCachingStateful = BlockManagerNoCachingMachine.TestCase
TestBlockManagerNoCachingStateful.settings = settings(_STATEFUL_SETTINGS, max_examples=60)

"""Bookkeeping for the paged KV pool: block ownership, ref counts and the prefix cache.

No tensors live here. The pool has ``num_blocks`` blocks of ``block_size`` tokens; a sequence
owns an ordered list of block ids (its block table). A block with ref count 0 is free and sits
in one free queue. A full block can be committed under its chained content hash
(``engine.block_hash``); while that hash is cached, a request whose prompt starts with the same
tokens gets the block back from ``match_prefix`` instead of recomputing it, even after the block
was freed, until allocation pops it off the free queue and evicts the hash.

Free-queue order (allocation pops the head):

* A freed block with no hash can never be revived, so it goes to the head and is reused first;
  that keeps low ids in circulation and a sequence's blocks consecutive.
* A freed block with a hash goes to the tail (least recently used is evicted first). A
  sequence's blocks are appended last block first: a prefix hit needs the leading blocks, so
  the tail of a chain is the part worth evicting first.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.cache_events import CacheEventLog
from engine.errors import EngineError, ResourceExhaustedError


class NoFreeBlocksError(ResourceExhaustedError):
    """Fewer free blocks than asked for; nothing was allocated."""


class BlockStateError(EngineError):
    """A caller broke the block-accounting contract (double free, unknown or unowned block).

    This is a bug in the caller, never a capacity condition; the manager's state is unchanged.
    """


@dataclass(frozen=True)
class PrefixHit:
    """Cached blocks covering the longest cached full-block prefix of a prompt.

    The blocks are already ref-counted for the caller, who must ``free`` them when done.
    """

    block_ids: tuple[int, ...]
    num_tokens: int


def contiguous_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Merge ids that each follow the previous one by +1 into ``(start, length)`` runs, in order.

    ``[3, 4, 5, 9, 2]`` gives ``[(3, 3), (9, 1), (2, 1)]``; an empty input gives ``[]``.
    """
    runs: list[tuple[int, int]] = []
    start = prev = -2
    length = 0
    for block_id in block_ids:
        if length and block_id == prev + 1:
            length += 1
        else:
            if length:
                runs.append((start, length))
            start, length = block_id, 1
        prev = block_id
    if length:
        runs.append((start, length))
    return runs


class BlockManager:
    """Owns the ref counts, free queue and hash cache of a pool of KV blocks.

    Every operation costs O(number of blocks it touches). Misuse (double free, unknown ids,
    negative counts) raises ``BlockStateError`` and leaves the state unchanged.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        enable_prefix_caching: bool = True,
        events: CacheEventLog | None = None,
    ) -> None:
        """``events``: told every hash that enters or leaves the prefix cache (a worker
        publishes them to the scheduler, ``engine.cache_events``)."""
        if num_blocks <= 0:
            raise BlockStateError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise BlockStateError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        # Keys only; OrderedDict gives O(1) pop from either end and removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of_block: dict[int, int] = {}
        self._block_of_hash: dict[int, int] = {}
        self._events = events

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: ref count 0, cached-but-evictable ones included."""
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (ceiling division)."""
        if num_tokens < 0:
            raise BlockStateError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        """Whether ``allocate(n)`` would succeed now."""
        self._check_count(n)
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks off the head of the free queue, each with ref count 1 and no hash.

        Taking a cached block evicts its hash. Raises ``NoFreeBlocksError`` with nothing
        allocated when fewer than ``n`` blocks are free.
        """
        self._check_count(n)
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        blocks: list[int] = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block_hash = self._hash_of_block.pop(block_id, None)
            if block_hash is not None:
                del self._block_of_hash[block_hash]
                if self._events is not None:
                    self._events.removed(block_hash)
            self._ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def match_prefix(self, block_hashes: Sequence[int]) -> PrefixHit:
        """Claim the cached blocks for the longest run of leading ``block_hashes`` in the cache.

        Each returned block's ref count goes up by one; a free (evictable) one leaves the free
        queue. Returns an empty hit when prefix caching is disabled.
        """
        hit: list[int] = []
        if self.enable_prefix_caching:
            for block_hash in block_hashes:
                block_id = self._block_of_hash.get(block_hash)
                if block_id is None:
                    break
                hit.append(block_id)
            for block_id in hit:
                if self._ref_counts[block_id] == 0:
                    del self._free[block_id]
                self._ref_counts[block_id] += 1
        return PrefixHit(block_ids=tuple(hit), num_tokens=len(hit) * self.block_size)

    def cached_prefix_length(self, block_hashes: Sequence[int]) -> int:
        """How many leading ``block_hashes`` ``match_prefix`` would claim now (claims none)."""
        n = 0
        if self.enable_prefix_caching:
            for block_hash in block_hashes:
                if block_hash not in self._block_of_hash:
                    break
                n += 1
        return n

    def commit_full_block(self, block_id: int, block_hash: int) -> None:
        """Record that owned block ``block_id`` is full and holds the content ``block_hash`` names.

        If another block already holds ``block_hash``, that mapping is kept and ``block_id``
        stays unhashed (a private copy, never offered to ``match_prefix``). Committing a block
        again under the same hash is a no-op; under a different hash it is a ``BlockStateError``
        (a full block's content never changes). A no-op when prefix caching is disabled.
        """
        self._check_block(block_id)
        if self._ref_counts[block_id] == 0:
            raise BlockStateError(f"block {block_id} is free; only an owned block can be committed")
        if not self.enable_prefix_caching:
            return
        current = self._hash_of_block.get(block_id)
        if current is not None:
            if current != block_hash:
                raise BlockStateError(
                    f"block {block_id} already committed as {current:#x}, not {block_hash:#x}"
                )
            return
        if block_hash in self._block_of_hash:
            return
        self._hash_of_block[block_id] = block_hash
        self._block_of_hash[block_hash] = block_id
        if self._events is not None:
            self._events.stored(block_hash)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block in ``block_ids`` (a block may appear more than once).

        A block whose count reaches 0 returns to the free queue, keeping its hash until it is
        reallocated. Pass a sequence's block table in order; hashed blocks are queued last
        block first (see the module docstring). Raises ``BlockStateError`` with nothing changed
        if any block would drop below 0 (a double free) or is not a valid id.
        """
        drops = Counter(block_ids)
        for block_id, count in drops.items():
            self._check_block(block_id)
            if count > self._ref_counts[block_id]:
                raise BlockStateError(
                    f"double free of block {block_id}: ref count {self._ref_counts[block_id]}, "
                    f"freed {count} times"
                )
        unhashed: list[int] = []
        for block_id in reversed(block_ids):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if block_id in self._hash_of_block:
                    self._free[block_id] = None
                else:
                    unhashed.append(block_id)
        # ``unhashed`` is in reverse table order, so pushing each onto the head leaves them in
        # table order at the front of the queue.
        for block_id in unhashed:
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)

    def hold(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each owned block in ``block_ids``: its bytes stay as they are
        until the matching ``free`` (a reader off the engine thread copies them meanwhile).
        Raises ``BlockStateError`` with nothing changed if any block is free or unknown."""
        for block_id in block_ids:
            self._check_block(block_id)
            if self._ref_counts[block_id] == 0:
                raise BlockStateError(f"block {block_id} is free; only an owned block is held")
        for block_id in block_ids:
            self._ref_counts[block_id] += 1

    def ref_count(self, block_id: int) -> int:
        """Number of live references to ``block_id`` (0 when free)."""
        self._check_block(block_id)
        return self._ref_counts[block_id]

    def block_hash_of(self, block_id: int) -> int | None:
        """The hash ``block_id`` is cached under, or ``None`` if it is not in the prefix cache."""
        self._check_block(block_id)
        return self._hash_of_block.get(block_id)

    def usage(self) -> float:
        """Fraction of blocks with ref count > 0."""
        return (self.num_blocks - len(self._free)) / self.num_blocks

    def reset_prefix_cache(self) -> None:
        """Forget the hashes of all free blocks; blocks in use keep theirs."""
        for block_id in self._free:
            block_hash = self._hash_of_block.pop(block_id, None)
            if block_hash is not None:
                del self._block_of_hash[block_hash]
                if self._events is not None:
                    self._events.removed(block_hash)

    def cached_hashes(self) -> list[int]:
        """Every hash in the prefix cache now (held or evictable blocks)."""
        return list(self._block_of_hash)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the internal state is inconsistent. O(num_blocks)."""

        def require(ok: bool, what: str) -> None:
            if not ok:
                raise AssertionError(f"BlockManager invariant broken: {what}")

        require(len(self._ref_counts) == self.num_blocks, "ref count table size")
        require(all(c >= 0 for c in self._ref_counts), "negative ref count")
        free_by_count = {b for b, c in enumerate(self._ref_counts) if c == 0}
        require(set(self._free) == free_by_count, "free queue != blocks with ref count 0")
        require(len(self._hash_of_block) == len(self._block_of_hash), "hash maps differ in size")
        for block_id, block_hash in self._hash_of_block.items():
            require(0 <= block_id < self.num_blocks, f"hashed block {block_id} out of range")
            require(
                self._block_of_hash.get(block_hash) == block_id,
                f"hash of block {block_id} does not map back to it",
            )
        if not self.enable_prefix_caching:
            require(not self._hash_of_block, "hashes recorded with prefix caching disabled")

    def _check_block(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise BlockStateError(f"block id {block_id} not in [0, {self.num_blocks})")

    @staticmethod
    def _check_count(n: int) -> None:
        if n < 0:
            raise BlockStateError(f"block count must be >= 0, got {n}")

"""Which full KV blocks each KV store holds, as far as the workers' reports say.

Workers report the blocks they confirmed in their store (put, found there, loaded:
``HeartbeatRequest.stored_block_hashes``); the store evicts without telling anyone, so a
block counts as held for ``ttl_s`` after its last confirmation, and each store's index keeps
at most ``max_blocks`` (the oldest confirmations go first). Placement reads it through
``leading_run``; only the state loop writes it. Nothing here survives a scheduler restart:
the workers' next puts and loads fill it again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

DEFAULT_TTL_S = 600.0
DEFAULT_MAX_BLOCKS = 1 << 20


class StoreIndex:
    """Per store (its master's ``host:port``): block hash -> last confirmation time."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if ttl_s <= 0 or max_blocks < 1:
            raise ValueError("ttl_s must be > 0 and max_blocks >= 1")
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self._stores: dict[str, OrderedDict[int, float]] = {}

    def note(self, store: str, block_hashes: Iterable[int], now: float) -> None:
        """``block_hashes`` were confirmed in ``store`` at ``now``."""
        if not store:
            return
        blocks = self._stores.setdefault(store, OrderedDict())
        for block_hash in block_hashes:
            blocks[block_hash] = now
            blocks.move_to_end(block_hash)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def expire(self, now: float) -> int:
        """Forget confirmations older than ``ttl_s``; returns how many were dropped."""
        dropped = 0
        horizon = now - self.ttl_s
        for blocks in self._stores.values():
            while blocks and next(iter(blocks.values())) < horizon:
                blocks.popitem(last=False)
                dropped += 1
        return dropped

    def leading_run(self, store: str, block_hashes: Sequence[int], now: float) -> int:
        """How many leading ``block_hashes`` ``store`` holds, confirmed within ``ttl_s``."""
        blocks = self._stores.get(store)
        if not blocks:
            return 0
        horizon = now - self.ttl_s
        n = 0
        for block_hash in block_hashes:
            seen = blocks.get(block_hash)
            if seen is None or seen < horizon:
                break
            n += 1
        return n

    def __len__(self) -> int:
        return sum(len(b) for b in self._stores.values())

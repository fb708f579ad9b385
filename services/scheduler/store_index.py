"""Which full KV blocks each KV store holds, as far as the workers' reports say.

Workers report the blocks they confirmed in their store (put, found there, loaded:
``HeartbeatRequest.stored_block_hashes``) and the blocks a lookup of theirs found missing
(evicted, or never stored: ``store_missing_block_hashes``). A block counts as held from its
confirmation until a report says it is missing; no clock guesses at what the store evicted
meanwhile. A stale entry costs one placement at most: the worker it sends the prompt to
looks the prefix up before relying on it (a decode worker placed for a short local prefill
goes to a prefill worker instead when the store falls short,
``services.decode.server``), and its miss removes the entry for every later placement.

Each store's index keeps at most ``max_blocks`` (the oldest confirmations go first).
Placement reads it through ``leading_run``; only the state loop writes it. Nothing here
survives a scheduler restart: the workers' next puts and loads fill it again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

DEFAULT_MAX_BLOCKS = 1 << 20


class StoreIndex:
    """Per store (its master's ``host:port``): the block hashes confirmed there, oldest
    confirmation first."""

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.max_blocks = max_blocks
        self._stores: dict[str, OrderedDict[int, None]] = {}

    def note(self, store: str, block_hashes: Iterable[int]) -> None:
        """``block_hashes`` were confirmed in ``store`` just now."""
        if not store:
            return
        blocks = self._stores.setdefault(store, OrderedDict())
        for block_hash in block_hashes:
            blocks[block_hash] = None
            blocks.move_to_end(block_hash)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def forget(self, store: str, block_hashes: Iterable[int]) -> int:
        """``block_hashes`` were found missing from ``store``; returns how many it listed."""
        blocks = self._stores.get(store)
        if not blocks:
            return 0
        dropped = 0
        for block_hash in block_hashes:
            if blocks.pop(block_hash, 0) is None:
                dropped += 1
        return dropped

    def leading_run(self, store: str, block_hashes: Sequence[int]) -> int:
        """How many leading ``block_hashes`` ``store`` holds, as far as reports say."""
        blocks = self._stores.get(store)
        if not blocks:
            return 0
        n = 0
        for block_hash in block_hashes:
            if block_hash not in blocks:
                break
            n += 1
        return n

    def __len__(self) -> int:
        return sum(len(b) for b in self._stores.values())

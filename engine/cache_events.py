"""What a worker's prefix cache gained and lost, handed from the engine thread to whoever
publishes it (the worker's registrar, on the event loop's thread).

The block manager reports each full block's chained hash when it enters the cache
(``stored``) and when its block is reallocated or the cache is reset (``removed``). The log
keeps, under one lock, the set of hashes cached now and the net change since the last
``drain``: a hash stored then removed before a drain is simply absent, so a publisher that
applies ``removed`` and then ``added`` to its copy of the set always ends at the truth.

Bounded: the pending change never grows past ``max_pending`` hashes. Past that (the
publisher is cut off, e.g. the scheduler is down) the change is dropped and the next
``drain`` says ``overflowed``: the publisher sends a ``snapshot`` instead, which is the
whole cached set (at most the pool's block count).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

DEFAULT_MAX_PENDING = 65536


@dataclass(frozen=True)
class CacheDelta:
    """The net change since the previous ``drain`` (or ``snapshot``).

    ``overflowed``: changes were dropped; ``added``/``removed`` are empty and only a
    snapshot brings a reader back in step.
    """

    added: tuple[int, ...]
    removed: tuple[int, ...]
    overflowed: bool = False

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.overflowed)


class CacheEventLog:
    """The published view of one block pool's prefix cache; safe to use from two threads."""

    def __init__(self, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._max_pending = max_pending
        self._lock = threading.Lock()
        self._cached: set[int] = set()
        self._pending: dict[int, bool] = {}  # hash -> cached after the change
        self._overflowed = False

    def stored(self, block_hash: int) -> None:
        """A full block entered the cache under ``block_hash``."""
        self._record(block_hash, True)

    def removed(self, block_hash: int) -> None:
        """The block cached under ``block_hash`` left the cache."""
        self._record(block_hash, False)

    def _record(self, block_hash: int, cached: bool) -> None:
        with self._lock:
            if cached:
                self._cached.add(block_hash)
            else:
                self._cached.discard(block_hash)
            if self._overflowed:
                return
            self._pending[block_hash] = cached
            if len(self._pending) > self._max_pending:
                self._pending.clear()
                self._overflowed = True

    @property
    def has_pending(self) -> bool:
        """Whether a ``drain`` would return a change (a cheap read, no lock)."""
        return bool(self._pending) or self._overflowed

    def drain(self) -> CacheDelta:
        """The net change since the previous drain or snapshot, which it then forgets."""
        with self._lock:
            pending, overflowed = self._pending, self._overflowed
            self._pending, self._overflowed = {}, False
        if overflowed:
            return CacheDelta((), (), overflowed=True)
        return CacheDelta(
            added=tuple(h for h, cached in pending.items() if cached),
            removed=tuple(h for h, cached in pending.items() if not cached),
        )

    def snapshot(self) -> tuple[int, ...]:
        """Every hash cached now; the pending change is forgotten (the snapshot covers it)."""
        with self._lock:
            self._pending, self._overflowed = {}, False
            return tuple(self._cached)

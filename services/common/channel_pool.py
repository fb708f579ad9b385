"""Channels to peers that come and go (decode workers for the gateway, prefill workers for a
decode worker): one per address, reused, and closed once idle.

Workers restart on new ports and scale in and out, so a cache keyed by address would only
grow. A channel is held for the length of a call (``acquire`` ... ``release``, or
``lease``); one that no call holds and none has used for ``idle_s`` is closed on the next
release, and at most ``max_idle`` idle channels are kept (the least recently used go
first). A held channel is never closed.
One owner: the event loop of the service that holds the pool (no locks).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc

from services.common.background import Background


@dataclass
class _Entry:
    channel: grpc.aio.Channel
    leases: int = 0
    last_used: float = 0.0


class ChannelPool:
    def __init__(
        self,
        open_channel: Callable[[str], grpc.aio.Channel],
        *,
        idle_s: float = 300.0,
        max_idle: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``open_channel(address)``: a new channel (``cluster_auth.channel`` with the
        service's options)."""
        self._open = open_channel
        self._idle_s = idle_s
        self._max_idle = max_idle
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._closing = Background()

    def __len__(self) -> int:
        return len(self._entries)

    def acquire(self, address: str) -> grpc.aio.Channel:
        """The channel to ``address``, held until ``release(address)``."""
        entry = self._entries.get(address)
        if entry is None:
            entry = self._entries[address] = _Entry(self._open(address))
        self._entries.move_to_end(address)
        entry.leases += 1
        return entry.channel

    def release(self, address: str) -> None:
        """One ``acquire`` of ``address`` is over."""
        entry = self._entries[address]
        entry.leases -= 1
        entry.last_used = self._clock()
        self._prune()

    @asynccontextmanager
    async def lease(self, address: str) -> AsyncIterator[grpc.aio.Channel]:
        """``acquire`` for the length of the block."""
        channel = self.acquire(address)
        try:
            yield channel
        finally:
            self.release(address)

    def _prune(self) -> None:
        now = self._clock()
        idle = [(a, e) for a, e in self._entries.items() if e.leases == 0]
        excess = len(idle) - self._max_idle
        for i, (address, entry) in enumerate(idle):
            if i < excess or now - entry.last_used > self._idle_s:
                del self._entries[address]
                self._closing.spawn(entry.channel.close())

    async def close(self) -> None:
        """Close every channel (the service is stopping)."""
        entries, self._entries = list(self._entries.values()), OrderedDict()
        for entry in entries:
            await entry.channel.close()

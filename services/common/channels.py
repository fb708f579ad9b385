"""Internal gRPC channels: how a connection notices a peer that went silent (keepalive),
how a channel to the scheduler dials it again after a restart (reconnect backoff), and the
pool of channels to peers that come and go. ``cluster_auth.channel`` opens each one.

Keepalive. A peer whose host lost its link sends nothing, not even a reset: TCP alone keeps
a call to it open until the call's deadline (a decode stream's is ten minutes), so a client
stream on it would hang. HTTP/2 keepalive pings find out: a channel with
``keepalive_options`` pings every ``interval_s`` while it has calls, and a ping unanswered
for ``interval_s`` closes the connection and fails its calls UNAVAILABLE, which callers
already treat as a lost peer (the gateway moves the stream). Internal servers take
``SERVER_OPTIONS``: pings at any rate, so a quiet healthy call (a stream waiting for its
prefill) is never cut for pinging too often.

Reconnect. gRPC's default reconnect backoff grows to 120 s, so a client whose scheduler was
down for half a minute could wait as long again after it is back. Capped at one second
(``SCHEDULER_CHANNEL_OPTIONS``), a restarted scheduler is found within a second of
listening.

The pool (``ChannelPool``). Channels to peers that come and go (decode workers for the
gateway, prefill workers for a decode worker): one per address, reused, and closed once
idle. Workers restart on new ports and scale in and out, so a cache keyed by address would
only grow. A channel is held for the length of a call (``acquire`` ... ``release``, or
``lease``); one that no call holds and none has used for ``idle_s`` is closed on the next
release, and at most ``max_idle`` idle channels are kept (the least recently used go
first). A held channel is never closed. One owner: the event loop of the service that holds
the pool (no locks).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc

from services.common.background import Background

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    # gRPC's default answers a third ping within 5 minutes of no data with GOAWAY
    # ("too_many_pings"), which would fail the very calls keepalive protects.
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 0),
)
"""Options of every internal gRPC server."""


def keepalive_options(interval_s: float) -> tuple[tuple[str, int], ...]:
    """Options of a channel that gives up on its peer within about ``2 * interval_s`` of
    silence. ``ValueError`` unless ``interval_s`` > 0."""
    if not interval_s > 0:
        raise ValueError(f"keepalive interval must be > 0, got {interval_s}")
    ms = max(1, round(interval_s * 1000))
    return (
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        # the deadline gRPC (1.6x) applies to an unanswered ping; 60 s by default
        ("grpc.http2.ping_timeout_ms", ms),
        ("grpc.keepalive_permit_without_calls", 0),  # an idle channel needs no pings
        # A server stream's client sends no data after its request: without this, gRPC
        # stops pinging after two pings.
        ("grpc.http2.max_pings_without_data", 0),
    )


SCHEDULER_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
"""Options of every ``grpc.aio`` channel to the scheduler."""


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

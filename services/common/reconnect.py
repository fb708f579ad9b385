"""How a channel to the scheduler dials it again after it went away (a restart).

gRPC's default reconnect backoff grows to 120 s, so a client whose scheduler was down for
half a minute could wait as long again after it is back. Capped at one second, a restarted
scheduler is found within a second of listening.
"""

from __future__ import annotations

SCHEDULER_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
"""Options of every ``grpc.aio`` channel to the scheduler."""

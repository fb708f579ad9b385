"""How an internal gRPC connection notices a peer that went silent.

A peer whose host lost its link sends nothing, not even a reset: TCP alone keeps a call to
it open until the call's deadline (a decode stream's is ten minutes), so a client stream on
it would hang. HTTP/2 keepalive pings find out: a channel with ``channel_options`` pings
every ``interval_s`` while it has calls, and a ping unanswered for ``interval_s`` closes the
connection and fails its calls UNAVAILABLE, which callers already treat as a lost peer (the
gateway moves the stream). Internal servers take ``SERVER_OPTIONS``: pings at any rate, so a
quiet healthy call (a stream waiting for its prefill) is never cut for pinging too often.
"""

from __future__ import annotations

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    # gRPC's default answers a third ping within 5 minutes of no data with GOAWAY
    # ("too_many_pings"), which would fail the very calls keepalive protects.
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 0),
)
"""Options of every internal gRPC server."""


def channel_options(interval_s: float) -> tuple[tuple[str, int], ...]:
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

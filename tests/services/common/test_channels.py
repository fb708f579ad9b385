"""services.common.channels.

Keepalive of internal calls: a stream whose peer goes silent (its host cut off: no data, no
reset) fails UNAVAILABLE within about twice the keepalive interval instead of hanging until
its deadline, and pings never cut a healthy stream that is merely quiet.

The pool: channels to peers that come and go are reused while in use and closed once idle,
so a gateway or decode worker that saw many workers restart on new ports does not keep a
channel to each of them forever."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import process
from services.common.channels import ChannelPool, keepalive_options
from services.common.cluster_auth import ClusterAuth

INTERVAL_S = 0.2
# gRPC pings at most once a second; a server with its defaults answers the fourth ping on a
# quiet connection with GOAWAY too_many_pings, which would fail the stream by 6 s.
QUIET_S = 6.0


class BlackHoleProxy:
    """Forwards TCP both ways until ``cut``; from then on it drops every byte and keeps
    the connections open, as a link that went down does."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.cut = False

    async def start(self) -> tuple[asyncio.Server, int]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return server, server.sockets[0].getsockname()[1]

    async def _serve(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        await asyncio.gather(self._pump(down_r, up_w), self._pump(up_r, down_w))

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while data := await src.read(65536):
            if not self.cut:
                dst.write(data)
                await dst.drain()


@contextlib.asynccontextmanager
async def internal_server() -> AsyncIterator[tuple[process.GrpcServer, int, BlackHoleProxy]]:
    """An internal server (cluster auth, open) and a proxy port in front of it."""
    server = process.GrpcServer(["pdserve.v1.Test"], "127.0.0.1", 0, auth=ClusterAuth())
    await server.start()
    proxy = BlackHoleProxy(server.port)
    listener, port = await proxy.start()
    try:
        yield server, port, proxy
    finally:
        listener.close()
        await server.stop(None)


async def _watch(channel: grpc.aio.Channel) -> grpc.aio.UnaryStreamCall:
    """A health Watch: a server stream that stays quiet until the status changes."""
    call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=60)
    first = await call.read()
    assert first.status == health_pb2.HealthCheckResponse.SERVING
    return call


async def test_a_stream_whose_peer_goes_silent_fails_unavailable_soon() -> None:
    async with internal_server() as (_, port, proxy):
        options = keepalive_options(INTERVAL_S)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options) as channel:
            call = await _watch(channel)
            proxy.cut = True
            with pytest.raises(grpc.aio.AioRpcError) as e:
                # a keepalive ping and its timeout, with room for a slow machine
                await asyncio.wait_for(call.read(), 10 * INTERVAL_S)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_pings_do_not_cut_a_quiet_healthy_stream() -> None:
    async with internal_server() as (server, port, _):
        options = keepalive_options(INTERVAL_S)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options) as channel:
            call = await _watch(channel)
            await asyncio.sleep(QUIET_S)  # pings, not a byte of data
            await server.set_serving(False)
            update = await asyncio.wait_for(call.read(), 5)
    assert update.status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_an_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="keepalive"):
        keepalive_options(0)


class _Channel:
    """Stands in for a grpc.aio.Channel: the pool only opens and closes channels."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.closed = False

    async def close(self) -> None:
        self.closed = True


async def test_idle_channels_are_closed_and_held_ones_never() -> None:
    now = [0.0]
    opened: list[_Channel] = []

    def open_channel(address: str) -> _Channel:
        opened.append(_Channel(address))
        return opened[-1]

    pool = ChannelPool(open_channel, idle_s=60, max_idle=2, clock=lambda: now[0])  # type: ignore[arg-type]
    held = pool.acquire("decode-a:1")
    async with pool.lease("decode-a:1") as again:
        assert again is held  # one channel per address, reused
    for port in range(2, 7):  # workers restarting on new ports, one request each
        async with pool.lease(f"decode-b:{port}"):
            now[0] += 1
    await asyncio.sleep(0)  # the closes run on the loop
    # the held one stays, and only the newest two idle ones
    assert len(pool) == 3 and not held.closed
    assert [c.closed for c in opened[1:]] == [True, True, True, False, False]
    now[0] += 61  # past idle_s: every idle channel goes at the next release
    pool.release("decode-a:1")
    await asyncio.sleep(0)
    assert len(pool) == 0 and all(c.closed for c in opened)
    await pool.close()

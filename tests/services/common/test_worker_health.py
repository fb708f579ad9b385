"""A worker whose KV data plane dies stops taking work: its health says NOT_SERVING."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import process
from services.common.worker import watch_data_plane
from tests.transfer.target import DST_LAYOUT
from transfer import tcp_receiver
from transfer.tcp import TcpTransport
from transfer.tcp_frames import parse_address


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        return reply.status


async def test_a_dead_kv_receiver_turns_the_worker_not_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = process.GrpcServer(["pdserve.v1.DecodeWorker"], "127.0.0.1", 0)
    await server.start()
    with TcpTransport() as transport:
        region = transport.register(DST_LAYOUT)
        watch = asyncio.create_task(
            watch_data_plane(lambda: transport.healthy, server, None, every_s=0.05)
        )
        try:
            await asyncio.sleep(0.2)
            assert not watch.done()
            assert await _health(server.address) == health_pb2.HealthCheckResponse.SERVING

            def broken(*args: object) -> None:
                raise ValueError("a bug in the acceptor")

            monkeypatch.setattr(tcp_receiver, "tune_socket", broken)
            await asyncio.to_thread(
                socket.create_connection, parse_address(region.handle.address), 2
            )
            await asyncio.wait_for(watch, 10)  # it saw the receiver die
            assert await _health(server.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            watch.cancel()
            await server.stop(None)

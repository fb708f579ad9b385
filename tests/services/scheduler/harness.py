"""Helpers of the scheduler's process tests: the scheduler's flags, workers played in-process
(real gRPC clients), /metrics reads."""

from __future__ import annotations

import asyncio
import contextlib
import re
import urllib.request
from collections.abc import AsyncIterator, Iterator

import grpc

from pdserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common import cluster_auth
from tests.services.scheduler.processes import Process, worker_info

TTL_S = 1.0
"""The default lease of these tests."""


class FakeWorker:
    """A worker played in-process: registers, then heartbeats until stopped."""

    def __init__(
        self,
        stub: scheduler_pb2_grpc.SchedulerStub,
        worker_id: str,
        role: int,
        ttl_s: float = TTL_S,
        **load: int,
    ) -> None:
        self.stub = stub
        self.ttl_s = ttl_s
        self.worker_id = worker_id
        self.info = worker_info(worker_id, role)
        self.load = scheduler_pb2.LoadSnapshot(free_kv_blocks=1000, total_kv_blocks=1000, **load)
        self.cached: list[int] = []
        self.sequence = 0
        self.snapshot = True
        self.interval_s = 0.1
        self.resyncs = 0
        self.task: asyncio.Task[None] | None = None

    async def register(self) -> None:
        reply = await self.stub.RegisterWorker(
            scheduler_pb2.RegisterWorkerRequest(worker=self.info), timeout=5
        )
        assert reply.lease_ttl_ms == int(self.ttl_s * 1000)
        assert 0 < reply.heartbeat_interval_ms < reply.lease_ttl_ms
        self.interval_s = reply.heartbeat_interval_ms / 1000
        self.sequence = 0
        self.snapshot = True

    async def beat(self) -> scheduler_pb2.HeartbeatReply:
        reply = await self.stub.Heartbeat(
            scheduler_pb2.HeartbeatRequest(
                worker_id=self.worker_id,
                state=scheduler_pb2.WORKER_STATE_SERVING,
                sequence=self.sequence,
                load=self.load,
                cached_block_hashes_added=self.cached if self.snapshot else [],
                cache_snapshot=self.snapshot,
            ),
            timeout=2,
        )
        self.sequence += 1
        self.snapshot = reply.resync_cache
        self.resyncs += reply.resync_cache
        return reply

    def start(self) -> None:
        async def loop() -> None:
            while True:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await self.beat()
                await asyncio.sleep(self.interval_s)

        self.task = asyncio.create_task(loop())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


def scheduler_flags(redis_url: str, prefix: str, metrics_port: int, ttl_s: float) -> list[str]:
    return [
        "--grpc-host", "127.0.0.1",
        "--grpc-port", "0",
        "--metrics-host", "127.0.0.1",
        "--metrics-port", str(metrics_port),
        "--redis-url", redis_url,
        "--redis-key-prefix", prefix,
        "--heartbeat-ttl-s", str(ttl_s),
        "--drain-timeout-s", "2",
    ]  # fmt: skip


@contextlib.contextmanager
def running(*procs: Process) -> Iterator[None]:
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.log_path.unlink(missing_ok=True)


def metric(port: int, name: str, labels: str = "") -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
        text = resp.read().decode()
    pattern = "^" + re.escape(name + (f"{{{labels}}}" if labels else "")) + r" ([0-9.e+-]+)$"
    match = re.search(pattern, text, re.MULTILINE)
    assert match, f"{name}{{{labels}}} not in /metrics"
    return float(match.group(1))


def place_request(request_id: str, hashes: tuple[int, ...] = ()) -> scheduler_pb2.PlaceRequest:
    return scheduler_pb2.PlaceRequest(
        request_id=request_id,
        model="m",
        prompt_tokens=64,
        max_tokens=64,
        prompt_block_hashes=hashes,
        hash_block_size=16,
    )


@contextlib.asynccontextmanager
async def open_channel(address: str) -> AsyncIterator[grpc.aio.Channel]:
    channel = cluster_auth.channel(address)
    try:
        yield channel
    finally:
        await channel.close()

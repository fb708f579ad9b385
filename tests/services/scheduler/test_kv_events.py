"""KV events from workers to the scheduler and the placement state in Redis, with the real
``Registrar`` and ``CacheEventLog`` (what every engine worker runs), a real scheduler
process and a real redis-server.

p2 is the prefix holder throughout: on equal load the cost rule's tie goes to the lower
worker id, p1, so a placement on p2 shows the scheduler knew where the prefix is.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc
import pytest
import redis

from engine.cache_events import CacheEventLog
from pdserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common.registration import Registrar
from tests.redis_server import RedisServer, free_port
from tests.services.scheduler.harness import (
    open_channel,
    place_request,
    running,
    scheduler_flags,
)
from tests.services.scheduler.processes import start_scheduler, worker_info

HASHES = (101, 202, 303, 404)  # a 64-token prompt's 4 full blocks (16-token blocks)
TTL_S = 5.0  # long enough that a restarted scheduler finds the leases in Redis


async def _until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not await check():
        assert time.monotonic() - started < timeout_s, what
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def test_events_route_placements_and_redis_carries_them_over_a_restart(
    redis_server: RedisServer, sync_redis: redis.Redis, prefix: str
) -> None:
    port = free_port()
    flags = [*scheduler_flags(redis_server.url, prefix, 0, TTL_S), "--grpc-port", str(port)]
    address = f"127.0.0.1:{port}"
    load = scheduler_pb2.LoadSnapshot(free_kv_blocks=1000, total_kv_blocks=1000)
    logs = {w: CacheEventLog() for w in ("d1", "p1", "p2")}
    roles = {"d1": common_pb2.WORKER_ROLE_DECODE, "p1": common_pb2.WORKER_ROLE_PREFILL,
             "p2": common_pb2.WORKER_ROLE_PREFILL}  # fmt: skip
    registrars = {
        w: Registrar(address, worker_info(w, roles[w]), lambda: load, cache=logs[w]) for w in logs
    }
    tasks = {w: asyncio.create_task(r.run()) for w, r in registrars.items()}
    n = 0

    async def place() -> scheduler_pb2.Placement:
        nonlocal n
        n += 1
        return await stub.Place(place_request(f"r{n}", HASHES), timeout=2)

    async def routed_to(worker_id: str, cached: int) -> bool:
        try:
            placement = await place()
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e  # no worker heartbeat yet
            return False
        return (placement.prefill.worker_id, placement.expected_cached_tokens) == (
            worker_id,
            cached,
        )

    def holders(block_hash: int) -> set[str]:
        return sync_redis.smembers(f"{prefix}:prefix:{block_hash}")  # type: ignore[return-value]

    first = start_scheduler(*flags)
    try:
        with running(first):
            async with open_channel(address) as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                await _until(lambda: routed_to("p1", 0), 10, "workers never registered")

                # A delta: p2 stored three blocks (the engine thread's calls).
                for h in HASHES[:3]:
                    logs["p2"].stored(h)
                took = await _until(lambda: routed_to("p2", 48), 2, "p2's blocks never counted")
                print(f"a stored block counts for placement after {took * 1000:.0f} ms")
                assert holders(HASHES[0]) == {"p2"}

                # Eviction of the first block makes the rest useless (chained hashes).
                logs["p2"].removed(HASHES[0])
                await _until(lambda: routed_to("p1", 0), 2, "p2's eviction never counted")
                assert holders(HASHES[0]) == set() and holders(HASHES[1]) == {"p2"}
                logs["p2"].stored(HASHES[0])
                await _until(lambda: routed_to("p2", 48), 2, "p2's block never came back")

        # The workers fall silent, the scheduler is killed (-9) and a new one starts on the
        # same port: it reads the registry and index from Redis, but Redis is no trust
        # root, so nothing is placed on a worker until it has registered again.
        for t in tasks.values():
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        silent = time.monotonic()
        second = start_scheduler(*flags)
        with running(second):
            async with open_channel(address) as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await place()
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, second.log_tail()

                # d1 and p1 register and heartbeat again; p2 stays dead: within its lease
                # its entries leave the index and Redis.
                for w in ("d1", "p1"):
                    registrar = Registrar(
                        address, worker_info(w, roles[w]), lambda: load, cache=logs[w]
                    )
                    tasks[w] = asyncio.create_task(registrar.run())

                async def gone() -> bool:
                    return not any("p2" in holders(h) for h in HASHES[:3]) and await routed_to(
                        "p1", 0
                    )

                await _until(gone, TTL_S + 3, "a dead worker's prefixes outlived its lease")
                assert time.monotonic() - silent <= TTL_S + 2
    finally:
        for t in tasks.values():
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)

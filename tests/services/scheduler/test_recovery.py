"""The scheduler process through a Redis restart and through its own kill -9 and restart,
with a real redis-server and real gRPC clients (workers played in-process)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest
import redis

from pdserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common import cluster_auth
from services.common.channels import SCHEDULER_CHANNEL_OPTIONS
from services.common.registration import Registrar
from tests.redis_server import RedisServer, free_port
from tests.services.scheduler.harness import (
    FakeWorker,
    metric,
    open_channel,
    place_request,
    running,
    scheduler_flags,
)
from tests.services.scheduler.processes import start_scheduler, worker_info

HASHES = (101, 202, 303)
OUTAGE_S = 1.5  # longer than the retries a write Redis refuses gets: held, not dropped


def _restored(r: redis.Redis, prefix: str) -> bool:
    return (
        all(r.exists(f"{prefix}:worker:{w}") for w in ("d1", "p1"))
        and all(r.smembers(f"{prefix}:prefix:{h}") == {"p1"} for h in HASHES)
        and r.hget(f"{prefix}:request:during-0", "status") == "placed"
    )


async def test_a_redis_restart_loses_nothing_the_scheduler_holds(prefix: str) -> None:
    with RedisServer.start() as server:
        metrics_port = free_port()
        flags = scheduler_flags(server.url, prefix, metrics_port, 1.0)
        scheduler = start_scheduler(*flags, "--redis-probe-s", "0.2", "--redis-timeout-s", "0.5")
        r = redis.Redis.from_url(server.url, decode_responses=True)
        with running(scheduler), contextlib.closing(r):
            async with open_channel(scheduler.address) as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                d1 = FakeWorker(stub, "d1", common_pb2.WORKER_ROLE_DECODE)
                p1 = FakeWorker(stub, "p1", common_pb2.WORKER_ROLE_PREFILL)
                p1.cached = list(HASHES)  # sent once, in the first heartbeat's snapshot
                for w in (d1, p1):
                    await w.register()
                    await w.beat()
                    w.start()
                try:
                    await asyncio.sleep(0.3)
                    assert r.smembers(f"{prefix}:prefix:{HASHES[0]}") == {"p1"}
                    server.kill()
                    # Redis down: placement goes on from memory, as fast as ever.
                    for i in range(3):
                        placement = await stub.Place(
                            place_request(f"during-{i}", HASHES), timeout=0.5
                        )
                        assert placement.prefill.worker_id == "p1"
                        assert placement.expected_cached_tokens == 48
                    await asyncio.sleep(OUTAGE_S)
                    assert metric(metrics_port, "pdserve_scheduler_redis_up") == 0
                    server.restart()  # empty: no persistence in this test
                    back = time.monotonic()
                    while not _restored(r, prefix):
                        assert time.monotonic() - back < 5, "Redis was not written again"
                        await asyncio.sleep(0.05)
                    assert metric(metrics_port, "pdserve_scheduler_redis_up") == 1
                    assert metric(metrics_port, "pdserve_scheduler_redis_remirrors_total") >= 1
                    placement = await stub.Place(place_request("after", HASHES), timeout=0.5)
                    assert placement.prefill.worker_id == "p1"
                finally:
                    for w in (d1, p1):
                        await w.stop()
            assert scheduler.proc.poll() is None, scheduler.log_tail()
            assert scheduler.terminate() == 0, scheduler.log_tail()


def _info(worker_id: str, role: int) -> common_pb2.WorkerInfo:
    return worker_info(worker_id, role)


async def _place_within(
    stub: scheduler_pb2_grpc.SchedulerStub, request_id: str, timeout_s: float
) -> tuple[float, list[grpc.StatusCode]]:
    """Place until it succeeds (seconds it took) and the codes of the failures before."""
    started = time.monotonic()
    codes: list[grpc.StatusCode] = []
    while True:
        try:
            await stub.Place(place_request(request_id), timeout=1)
            return time.monotonic() - started, codes
        except grpc.aio.AioRpcError as e:
            codes.append(e.code())
        assert time.monotonic() - started < timeout_s, f"no placement: {codes[-5:]}"
        await asyncio.sleep(0.1)


async def test_a_killed_scheduler_restarted_on_its_port_places_again(
    redis_server: RedisServer, prefix: str
) -> None:
    """Workers (the real ``Registrar``) re-register when the new scheduler does not know
    them; a client keeps its channel (as the gateway does): UNAVAILABLE while the scheduler
    is down, placements again once it is back."""
    port = free_port()
    ttl_s = 1.0  # shorter than a restart: the new scheduler starts cold
    flags = [*scheduler_flags(redis_server.url, prefix, 0, ttl_s), "--grpc-port", str(port)]
    first = start_scheduler(*flags)
    load = scheduler_pb2.LoadSnapshot(free_kv_blocks=1000, total_kv_blocks=1000)
    address = f"127.0.0.1:{port}"
    registrars = [
        Registrar(address, _info("d1", common_pb2.WORKER_ROLE_DECODE), lambda: load),
        Registrar(address, _info("p1", common_pb2.WORKER_ROLE_PREFILL), lambda: load),
    ]
    tasks = [asyncio.create_task(r.run()) for r in registrars]
    try:
        with running(first):
            channel = cluster_auth.channel(address, options=SCHEDULER_CHANNEL_OPTIONS)
            async with channel:  # the gateway's channel to the scheduler
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                await _place_within(stub, "before", timeout_s=10)
                first.kill()
                down = time.monotonic()
                await asyncio.sleep(ttl_s + 0.5)  # the leases lapse in Redis too
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Place(place_request("while-down"), timeout=1)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                second = start_scheduler(*flags)
                with running(second):
                    took, codes = await _place_within(stub, "after", timeout_s=15)
                    assert set(codes) <= {grpc.StatusCode.UNAVAILABLE}, codes
                    assert "worker_registered" in second.log_tail()
                    print(f"placements again {took:.2f} s after the new scheduler was ready "
                          f"({time.monotonic() - down:.2f} s after the kill)")  # fmt: skip
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

"""The scheduler as a real process, with a real Redis and real gRPC clients as workers.

Victim workers are real processes that get SIGKILLed; survivors are played by this test
process (RegisterWorker/Heartbeat over gRPC, a real client of the real server).
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.redis_server import RedisServer, free_port
from tests.services.scheduler.harness import (
    TTL_S,
    FakeWorker,
    metric,
    open_channel,
    place_request,
    running,
    scheduler_flags,
)
from tests.services.scheduler.processes import Process, start_scheduler, start_worker

HASHES = (101, 202, 303)  # the prompt's chained block hashes (16-token blocks)


async def test_killed_workers_are_dropped_within_the_lease(
    redis_server: RedisServer, sync_redis: redis.Redis, prefix: str
) -> None:
    metrics_port = free_port()
    scheduler = start_scheduler(*scheduler_flags(redis_server.url, prefix, metrics_port, TTL_S))
    with running(scheduler):
        # Victims are real processes; p1 caches the prompt's prefix, so it wins while alive.
        d1 = start_worker(scheduler.address, "d1", "decode")
        p1 = start_worker(scheduler.address, "p1", "prefill", cached=HASHES)
        with running(d1, p1):
            async with open_channel(scheduler.address) as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                health = health_pb2_grpc.HealthStub(channel)
                check = await health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                assert check.status == health_pb2.HealthCheckResponse.SERVING
                check = await health.Check(
                    health_pb2.HealthCheckRequest(service="pdserve.v1.Scheduler"), timeout=2
                )
                assert check.status == health_pb2.HealthCheckResponse.SERVING

                d2 = FakeWorker(stub, "d2", common_pb2.WORKER_ROLE_DECODE)
                p2 = FakeWorker(stub, "p2", common_pb2.WORKER_ROLE_PREFILL)
                for w in (d2, p2):
                    await w.register()
                    await w.beat()
                    w.start()
                try:
                    await _check_placements_and_kill(
                        stub, sync_redis, prefix, metrics_port, d1, p1, d2
                    )
                finally:
                    for w in (d2, p2):
                        await w.stop()
        assert scheduler.terminate() == 0, scheduler.log_tail()


async def _check_placements_and_kill(
    stub: scheduler_pb2_grpc.SchedulerStub,
    r: redis.Redis,
    prefix: str,
    metrics_port: int,
    d1: Process,
    p1: Process,
    d2: FakeWorker,
) -> None:
    assert metric(metrics_port, "pdserve_scheduler_workers", 'role="decode"') == 2
    assert metric(metrics_port, "pdserve_scheduler_workers", 'role="prefill"') == 2

    # Both decode workers take placements; the prefix-holding p1 gets the prefill (it
    # computes 16 of the 64 tokens, p2 all 64). Outcomes after the first keep p1's backlog
    # at one prompt: with more, its cost would pass p2's (test_policy covers that).
    decodes: set[str] = set()
    for i in range(6):
        placement = await stub.Place(place_request(f"before-{i}", HASHES), timeout=2)
        decodes.add(placement.decode.worker_id)
        assert placement.prefill.worker_id == "p1"
        assert placement.expected_cached_tokens == 48
        if i:
            await stub.ReportOutcome(
                scheduler_pb2.Outcome(
                    request_id=f"before-{i}",
                    prefill_worker_id="p1",
                    decode_worker_id=placement.decode.worker_id,
                    finish_reason=common_pb2.FINISH_REASON_STOP,
                ),
                timeout=2,
            )
    assert decodes == {"d1", "d2"}

    # Request records: status, placement and timestamps, with a TTL.
    await asyncio.sleep(0.2)  # the write-behind store runs off the placement path
    record = r.hgetall(f"{prefix}:request:before-0")
    assert record["status"] == "placed" and record["prefill"] == "p1"
    assert record["decode"] in ("d1", "d2") and int(record["placed_unix_ns"]) > 0
    assert 0 < r.pttl(f"{prefix}:request:before-0") <= 3600 * 1000
    assert r.exists(f"{prefix}:worker:d1") and 0 < r.pttl(f"{prefix}:worker:d1") <= 1000
    assert r.smembers(f"{prefix}:prefix:{HASHES[0]}") == {"p1"}

    await stub.ReportOutcome(
        scheduler_pb2.Outcome(
            request_id="before-0",
            prefill_worker_id="p1",
            decode_worker_id=record["decode"],
            finish_reason=common_pb2.FINISH_REASON_STOP,
            usage=common_pb2.Usage(prompt_tokens=64, completion_tokens=10),
        ),
        timeout=2,
    )

    killed_at = time.monotonic()
    d1.kill()
    p1.kill()
    dropped_after = None
    while time.monotonic() - killed_at < 3 * TTL_S:
        decode = metric(metrics_port, "pdserve_scheduler_workers", 'role="decode"')
        prefill = metric(metrics_port, "pdserve_scheduler_workers", 'role="prefill"')
        if decode == 1 and prefill == 1:
            dropped_after = time.monotonic() - killed_at
            break
        await asyncio.sleep(0.05)
    assert dropped_after is not None, "the killed workers were never dropped"
    # Their last heartbeat was at most one interval before the kill; the expiry tick and
    # the metrics poll add < 0.2 s; the rest is slack for this shared 2-core machine.
    assert dropped_after <= TTL_S + 0.5, dropped_after

    for i in range(8):
        placement = await stub.Place(place_request(f"after-{i}", HASHES), timeout=2)
        assert placement.decode.worker_id == "d2"
        assert placement.prefill.worker_id == "p2"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Heartbeat(
            scheduler_pb2.HeartbeatRequest(
                worker_id="d1", state=scheduler_pb2.WORKER_STATE_SERVING, sequence=99
            ),
            timeout=2,
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert metric(metrics_port, "pdserve_scheduler_expired_workers_total") == 2

    await asyncio.sleep(0.2)
    assert not r.exists(f"{prefix}:worker:d1") and not r.exists(f"{prefix}:worker:p1")
    assert r.smembers(f"{prefix}:prefix:{HASHES[0]}") == set()
    outcome = r.hgetall(f"{prefix}:request:before-0")
    assert outcome["status"] == "finished" and outcome["completion_tokens"] == "10"

    # Back-pressure: the survivor reports 10 free blocks; 25 are needed.
    d2.load.free_kv_blocks = 10
    await asyncio.sleep(2.5 * d2.interval_s)  # two heartbeats carry the new load
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Place(
            scheduler_pb2.PlaceRequest(
                request_id="no-room", model="m", prompt_tokens=200, max_tokens=200
            ),
            timeout=2,
        )
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    retry_after = dict(err.value.trailing_metadata() or ())["retry-after-ms"]
    assert 0 < int(retry_after) <= TTL_S * 1000
    assert metric(metrics_port, "pdserve_scheduler_rejections_total", 'reason="capacity"') == 1
    # Contract violations are INVALID_ARGUMENT, never a crash.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Place(scheduler_pb2.PlaceRequest(request_id="x", max_tokens=1), timeout=2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Place(
            scheduler_pb2.PlaceRequest(request_id="y", model="nope", prompt_tokens=1, max_tokens=1),
            timeout=2,
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_sigterm_drains_and_a_restart_takes_workers_back_as_they_register(
    redis_server: RedisServer, sync_redis: redis.Redis, prefix: str
) -> None:
    ttl_s = 5.0  # long enough that the leases outlive the restart
    flags = scheduler_flags(redis_server.url, prefix, 0, ttl_s)
    first = start_scheduler(*flags)
    with running(first):
        async with open_channel(first.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            decode = FakeWorker(stub, "d1", common_pb2.WORKER_ROLE_DECODE)
            prefill = FakeWorker(stub, "p1", common_pb2.WORKER_ROLE_PREFILL)
            prefill.cached = list(HASHES[:2])
            for w in (decode, prefill):
                reply = await w.stub.RegisterWorker(
                    scheduler_pb2.RegisterWorkerRequest(worker=w.info), timeout=5
                )
                assert reply.lease_ttl_ms == int(ttl_s * 1000)
                await w.beat()
            placement = await stub.Place(place_request("r1", HASHES), timeout=2)
            assert placement.expected_cached_tokens == 32

            # SIGTERM: the health service says NOT_SERVING before the server goes away.
            health = health_pb2_grpc.HealthStub(channel)
            watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=10)
            statuses = [(await watch.read()).status]
            first.proc.send_signal(signal.SIGTERM)
            statuses.append((await watch.read()).status)
            watch.cancel()
            assert statuses == [
                health_pb2.HealthCheckResponse.SERVING,
                health_pb2.HealthCheckResponse.NOT_SERVING,
            ]
            assert first.proc.wait(10) == 0, first.log_tail()
            assert '"stopped"' in first.log_tail()

        # The workers are silent now; their Redis keys still hold what is left of the lease.
        assert 0 < sync_redis.pttl(f"{prefix}:worker:d1") <= ttl_s * 1000
        second = start_scheduler(*flags)
        with running(second):
            async with open_channel(second.address) as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                # The registry came back from Redis, as hints only (Redis is no trust root):
                # nothing is placed on a worker, and its heartbeats are NOT_FOUND, until it
                # registers again.
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Place(place_request("r2", HASHES), timeout=2)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                for w in (decode, prefill):
                    w.stub, w.ttl_s = stub, ttl_s
                    with pytest.raises(grpc.aio.AioRpcError) as unknown:
                        await w.beat()
                    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
                    assert "must register again" in (unknown.value.details() or "")
                    await w.register()
                    assert not (await w.beat()).resync_cache  # its snapshot: the cache
                placement = await stub.Place(place_request("r2", HASHES), timeout=2)
                assert placement.decode.worker_id == "d1"
                assert placement.prefill.worker_id == "p1"
                assert placement.expected_cached_tokens == 32
            assert second.terminate() == 0, second.log_tail()

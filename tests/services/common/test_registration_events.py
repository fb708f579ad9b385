"""The registrar's KV-event publishing against a scripted scheduler over real gRPC: deltas
between heartbeats, and a snapshot after registering, after a failed heartbeat, when the
scheduler asks (``resync_cache``) and after the event log overflowed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from engine.cache_events import CacheEventLog
from pdserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common.registration import Registrar
from tests.services.scheduler.processes import worker_info


class ScriptedScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Records every heartbeat; ``fail_next`` / ``resync_next`` / ``forget_next`` script the
    next answer."""

    def __init__(self) -> None:
        self.beats: asyncio.Queue[scheduler_pb2.HeartbeatRequest] = asyncio.Queue()
        self.fail_next = False
        self.resync_next = False
        self.forget_next = False
        self.registrations = 0

    async def RegisterWorker(self, request, context):  # type: ignore[no-untyped-def]
        self.registrations += 1
        return scheduler_pb2.RegisterWorkerReply(heartbeat_interval_ms=60_000, lease_ttl_ms=1)

    async def Heartbeat(self, request, context):  # type: ignore[no-untyped-def]
        self.beats.put_nowait(request)
        if self.fail_next:
            self.fail_next = False
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted failure")
        if self.forget_next:
            self.forget_next = False
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown worker_id")
        resync, self.resync_next = self.resync_next, False
        return scheduler_pb2.HeartbeatReply(resync_cache=resync, heartbeat_interval_ms=60_000)


@pytest.fixture
async def scheduler() -> AsyncIterator[tuple[ScriptedScheduler, str]]:
    servicer = ScriptedScheduler()
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(None)


async def test_deltas_between_snapshots_and_a_snapshot_whenever_one_may_be_lost(
    scheduler: tuple[ScriptedScheduler, str],
) -> None:
    servicer, address = scheduler
    log = CacheEventLog(max_pending=4)
    log.stored(1)  # cached before the worker registered
    load = scheduler_pb2.LoadSnapshot(free_kv_blocks=10, total_kv_blocks=10)
    registrar = Registrar(address, worker_info("p1", common_pb2.WORKER_ROLE_PREFILL),
                          lambda: load, cache=log, event_interval_s=0.01)  # fmt: skip
    task = asyncio.create_task(registrar.run())

    async def beat() -> scheduler_pb2.HeartbeatRequest:
        return await asyncio.wait_for(servicer.beats.get(), 5)

    def cache_of(b: scheduler_pb2.HeartbeatRequest) -> tuple[bool, set[int], set[int]]:
        added, removed = b.cached_block_hashes_added, b.cached_block_hashes_removed
        return b.cache_snapshot, set(added), set(removed)

    try:
        # The interval is a minute: every heartbeat below is sent early, for an event.
        assert cache_of(await beat()) == (True, {1}, set())  # first after registering
        log.stored(2)
        log.removed(1)
        first_delta = await beat()
        assert cache_of(first_delta) == (False, {2}, {1}) and first_delta.sequence == 1

        servicer.fail_next = True
        log.stored(3)
        assert cache_of(await beat()) == (False, {3}, set())  # this call fails ...
        log.stored(4)
        assert cache_of(await beat()) == (True, {2, 3, 4}, set())  # ... so a snapshot

        servicer.resync_next = True
        log.stored(5)
        assert cache_of(await beat()) == (False, {5}, set())  # answered resync_cache
        log.removed(5)
        assert cache_of(await beat()) == (True, {2, 3, 4}, set())

        for h in range(10, 16):  # more than max_pending (4) before the registrar runs
            log.stored(h)
        assert cache_of(await beat()) == (True, {2, 3, 4, *range(10, 16)}, set())

        # A scheduler that forgot the worker: it registers again at once (not a minute
        # later), and its first heartbeat to the new registration is a snapshot.
        servicer.forget_next = True
        log.stored(20)
        assert cache_of(await beat()) == (False, {20}, set())  # answered NOT_FOUND
        again = await beat()
        assert cache_of(again) == (True, {2, 3, 4, *range(10, 16), 20}, set())
        assert again.sequence == 0 and servicer.registrations == 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

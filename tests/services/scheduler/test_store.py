"""RedisStore against a real redis-server: keys, values, TTLs, read-back, bounded writes."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from services.scheduler.model import (
    FinishReason,
    Outcome,
    Placement,
    PrefillMode,
    Role,
    WorkerLoad,
    WorkerState,
)
from services.scheduler.redis_link import connect
from services.scheduler.store import (
    KeySpace,
    RedisStore,
    worker_info_from_json,
    worker_info_to_json,
)
from tests.redis_server import RedisServer, free_port
from tests.services.scheduler.builders import info, request

LEASE_MS = 2000


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.from_url(redis_server.url, decode_responses=True)
    yield c
    await c.aclose()


def _store(client: aioredis.Redis, queue_size: int = 100) -> RedisStore:
    return RedisStore(
        client,
        lease_ttl_ms=LEASE_MS,
        request_ttl_s=3600,
        prefix_ttl_s=600,
        queue_size=queue_size,
        keys=KeySpace(f"t{uuid.uuid4().hex[:8]}"),
    )


def _placement(request_id: str) -> Placement:
    return Placement(
        request_id=request_id,
        attempt=0,
        decode=info("d1", Role.DECODE),
        prefill=info("p1", Role.PREFILL),
        mode=PrefillMode.DISAGGREGATED,
        expected_cached_tokens=32,
        decode_kv_blocks=8,
    )


def test_worker_info_json_round_trip() -> None:
    w = info("w1", Role.COLOCATED, transports=("shm", "tcp"))
    assert worker_info_from_json(worker_info_to_json(w)) == w


async def test_worker_and_prefix_keys_round_trip(client: aioredis.Redis) -> None:
    store = _store(client)
    keys = store.keys
    store.start()
    d1, p1 = info("d1", Role.DECODE), info("p1", Role.PREFILL)
    load = WorkerLoad(running_requests=2, free_kv_blocks=700, total_kv_blocks=1000)
    store.put_worker(d1, WorkerState.SERVING, load, registered_unix_ns=123)
    store.put_worker(p1, WorkerState.DRAINING, WorkerLoad(), registered_unix_ns=456)
    store.update_prefixes("p1", added=[10, 20], removed=[])
    store.update_prefixes("d1", added=[10], removed=[])
    store.update_prefixes("p1", added=[], removed=[20])
    assert await store.close(timeout_s=5)
    assert store.written == 5 and store.dropped == 0

    assert await client.type(keys.worker("d1")) == "hash"
    assert 0 < await client.pttl(keys.worker("d1")) <= LEASE_MS
    fields = await client.hgetall(keys.worker("d1"))
    assert fields["state"] == "serving" and int(fields["registered_unix_ns"]) == 123
    assert int(fields["lease_ttl_ms"]) == LEASE_MS
    assert await client.smembers(keys.block(10)) == {"p1", "d1"}
    assert await client.smembers(keys.block(20)) == set()
    assert 0 < await client.pttl(keys.block(10)) <= 600_000

    workers = {w.info.worker_id: w for w in await store.load_workers()}
    assert workers["d1"].info == d1 and workers["d1"].load == load
    assert workers["p1"].state is WorkerState.DRAINING
    assert await store.load_prefix_index(["p1", "d1"]) == {10: {"p1", "d1"}}
    assert await store.load_prefix_index(["d1"]) == {10: {"d1"}}

    store.start()
    store.delete_worker("p1", cached_hashes=[10])
    assert await store.close(timeout_s=5)
    assert not await client.exists(keys.worker("p1"))
    assert await client.smembers(keys.block(10)) == {"d1"}


async def test_request_record_has_placement_then_outcome(client: aioredis.Redis) -> None:
    store = _store(client)
    store.start()
    req = request("req-1", prompt=100, max_tokens=20)
    store.record_placement(req, _placement("req-1"))
    assert await store.close(timeout_s=5)
    key = store.keys.request("req-1")
    record = await client.hgetall(key)
    assert record["status"] == "placed"
    assert (record["prefill"], record["decode"]) == ("p1", "d1")
    assert record["prefill_mode"] == "disaggregated" and record["prompt_tokens"] == "100"
    assert int(record["placed_unix_ns"]) > 0
    assert 3_590_000 < await client.pttl(key) <= 3_600_000

    store.start()
    store.record_outcome(
        Outcome(
            request_id="req-1",
            finish_reason=FinishReason.ABORT,
            decode_worker_id="d1",
            completion_tokens=7,
            finish_unix_ns=99,
        )
    )
    assert await store.close(timeout_s=5)
    record = await client.hgetall(key)
    assert record["status"] == "aborted" and record["finish_reason"] == "abort"
    assert record["completion_tokens"] == "7" and record["prefill"] == "p1"


async def test_writes_are_bounded_and_never_raise_when_redis_is_down() -> None:
    dead = connect(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2)
    store = _store(dead, queue_size=2)
    for i in range(5):  # queue holds 2: 3 are dropped at once, without blocking
        store.update_prefixes(f"w{i}", added=[i], removed=[])
    assert store.dropped == 3 and store.pending == 2
    store.start()
    started = time.monotonic()
    drained = await store.close(timeout_s=1)  # Redis never answers: the writes are held
    assert not drained and time.monotonic() - started < 1.5
    assert store.dropped == 5 and store.written == 0
    await dead.aclose()


async def test_writes_made_while_redis_is_down_are_written_once_it_is_back() -> None:
    with RedisServer.start() as server:
        client = connect(server.url, timeout_s=0.5)
        store = _store(client)
        store.start()
        store.update_prefixes("p1", added=[1], removed=[])
        while store.written < 1:
            await asyncio.sleep(0.01)
        server.kill()
        store.record_placement(request("r-down"), _placement("r-down"))
        store.update_prefixes("p1", added=[2], removed=[1])
        # Longer than the retries given to a batch Redis refuses: these are held, not dropped.
        await asyncio.sleep(1.5)
        assert store.written == 1 and store.dropped == 0
        server.restart()  # empty: what it held before is gone
        assert await store.close(timeout_s=5)
        check = aioredis.from_url(server.url, decode_responses=True)
        assert await check.hget(store.keys.request("r-down"), "status") == "placed"
        assert await check.smembers(store.keys.block(2)) == {"p1"}
        assert store.dropped == 0
        await check.aclose()
        await client.aclose()


async def test_a_batch_redis_refuses_is_dropped_after_a_few_retries(
    client: aioredis.Redis,
) -> None:
    store = _store(client)
    await client.set(store.keys.block(9), "not a set")
    store.start()
    store.update_prefixes("p1", added=[9], removed=[])  # SADD on a string: WRONGTYPE
    started = time.monotonic()
    while store.dropped == 0:
        assert time.monotonic() - started < 3, "a refused batch was retried for ever"
        await asyncio.sleep(0.02)
    store.update_prefixes("p1", added=[10], removed=[])  # the writer goes on
    assert await store.close(timeout_s=5)
    assert store.dropped == 1 and store.written == 1
    assert await client.smembers(store.keys.block(10)) == {"p1"}

"""Prefix routing follows the workers' block size: a real scheduler process (with a real
Redis) whose workers run 32-token blocks, and the gateway's cluster backend placing
through it. The gateway learns the size from its first placement and hashes every later
prompt in it, so the prefill worker that caches the prompt's blocks wins over an idle one.
"""

from __future__ import annotations

import uuid

import pytest

from engine.block_hash import hash_blocks
from engine.sampling_params import SamplingParams
from pdserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.gateway.backend import GenerateInput
from services.gateway.cluster_backend import ClusterBackend
from tests.redis_server import RedisServer, free_port, redis_server_fixture
from tests.services.scheduler.harness import (
    TTL_S,
    FakeWorker,
    open_channel,
    running,
    scheduler_flags,
)
from tests.services.scheduler.processes import start_scheduler

pytestmark = pytest.mark.asyncio

redis_server = redis_server_fixture(scope="module")

BLOCK = 32
PROMPT = tuple(range(1, 8 * BLOCK + 2))  # eight full blocks and one token
BACKLOG = 100  # the holder's queued prompt tokens: less than the prompt, so it still wins


def _request(request_id: str) -> GenerateInput:
    return GenerateInput(request_id, PROMPT, SamplingParams(max_tokens=8), "m")


async def _join(worker: FakeWorker) -> None:
    worker.info.capacity.block_size = BLOCK
    await worker.register()
    await worker.beat()
    worker.start()


async def test_workers_of_32_token_blocks_are_routed_by_prefix(redis_server: RedisServer) -> None:
    flags = scheduler_flags(redis_server.url, f"test-{uuid.uuid4().hex[:8]}", free_port(), TTL_S)
    scheduler = start_scheduler(*flags)
    backend = ClusterBackend(scheduler.address, worker_model="m")
    with running(scheduler):
        async with open_channel(scheduler.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            holder = FakeWorker(
                stub, "p-holder", common_pb2.WORKER_ROLE_PREFILL, queued_prompt_tokens=BACKLOG
            )
            holder.cached = hash_blocks(PROMPT, BLOCK)
            workers = [
                FakeWorker(stub, "d1", common_pb2.WORKER_ROLE_DECODE),
                FakeWorker(stub, "p-idle", common_pb2.WORKER_ROLE_PREFILL),
                holder,
            ]
            for w in workers:
                await _join(w)
            backend.start()
            try:
                # Before any placement the gateway cannot know the size: placed by load.
                first = await backend.place(_request("first"))
                assert first.prefill.worker_id == "p-idle"
                await stub.ReportOutcome(  # its load off p-idle again
                    scheduler_pb2.Outcome(
                        request_id="first",
                        prefill_worker_id="p-idle",
                        decode_worker_id="d1",
                        finish_reason=common_pb2.FINISH_REASON_STOP,
                    ),
                    timeout=2,
                )
                assert backend.prefix_hashes.block_size == BLOCK
                placed = await backend.place(_request("second"))
                assert placed.prefill.worker_id == "p-holder"
                assert placed.expected_cached_tokens == 8 * BLOCK
            finally:
                await backend.close()
                for w in workers:
                    await w.stop()

"""The fleet's batch target reaches the gateway: a real scheduler process (with a real
Redis) whose decode workers heartbeat their batch targets, and the gateway's cluster backend
placing through it; every placement tells the sum, which its admission takes as its cap."""

from __future__ import annotations

import uuid

import pytest

from engine.sampling_params import SamplingParams
from pdserve.v1 import common_pb2, scheduler_pb2_grpc
from services.gateway.admission import Admission, AdmissionLimits
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


async def test_placements_carry_the_fleet_s_batch_target_to_admission(
    redis_server: RedisServer,
) -> None:
    flags = scheduler_flags(redis_server.url, f"test-{uuid.uuid4().hex[:8]}", free_port(), TTL_S)
    scheduler = start_scheduler(*flags)
    backend = ClusterBackend(scheduler.address, worker_model="m")
    admission = Admission(AdmissionLimits(64, max_queued=64, follow_fleet=True))
    backend.on_target_batch = admission.follow
    with running(scheduler):
        async with open_channel(scheduler.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            workers = [
                FakeWorker(stub, "d1", common_pb2.WORKER_ROLE_DECODE, target_batch=5),
                FakeWorker(stub, "d2", common_pb2.WORKER_ROLE_DECODE, target_batch=3),
                FakeWorker(stub, "p1", common_pb2.WORKER_ROLE_PREFILL),
            ]
            for w in workers:
                await w.register()
                await w.beat()
                w.start()
            backend.start()
            try:
                request = GenerateInput("r1", tuple(range(1, 100)), SamplingParams(), "m")
                placement = await backend.place(request)
                assert placement.fleet_target_batch == 8
                assert admission.limits.max_concurrent == 8
                workers[1].load.target_batch = 6  # its batch target rises
                await workers[1].beat()
                await backend.place(
                    GenerateInput("r2", request.prompt_token_ids, request.params, "m")
                )
                assert admission.limits.max_concurrent == 11
            finally:
                await backend.close()
                for w in workers:
                    await w.stop()

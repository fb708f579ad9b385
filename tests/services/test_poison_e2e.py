"""A request that fails the same way on every worker is tried on two, not four (issue 37,
finding 5), with real processes: a scheduler, two prefill workers and a decode worker whose
prefill deadline no long prompt can meet, and the gateway's ``ClusterBackend``.

Each attempt's prefill ends DEADLINE_EXCEEDED on another prefill worker; the second time
the request ends with an error naming both, rather than moving on until the workers run
out (the code before this rule moved it twice more, ending in a local prefill on the decode
worker that succeeded after minutes of wasted prefills)."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.sampling_params import SamplingParams
from services.gateway.backend import BackendUnavailableError, GenerateInput
from services.gateway.cluster_backend import ClusterBackend
from tests.services.procs import ServiceProcess, start_service

pytestmark = pytest.mark.slow

PROMPT = tuple(range(1000, 3000))  # 2,000 tokens: far more than 0.2 s of prefill here


@pytest.fixture(scope="module")
def cluster():
    procs: list[ServiceProcess] = []
    try:
        sched = start_service(
            "services.scheduler", "--grpc-host", "127.0.0.1", "--grpc-port", "0",
            "--metrics-port", "0", "--redis-url", "", "--local-prefill-max-tokens", "0",
        )  # fmt: skip
        procs.append(sched)
        engine = ["--port", "0", "--kv-cache-mib", "64", "--threads", "1",
                  "--scheduler", sched.address, "--heartbeat-interval-s", "0.2"]  # fmt: skip
        for i in range(2):
            procs.append(start_service("services.prefill", *engine, "--worker-id", f"p{i}"))
        procs.append(start_service(
            "services.decode", *engine, "--worker-id", "d0", "--transport", "shm",
            "--prefill-deadline-s", "0.2",
        ))  # fmt: skip
        yield sched.address
    finally:
        for p in procs:
            p.stop()


async def test_a_request_failing_the_same_way_twice_ends_with_a_clear_error(cluster) -> None:
    backend = ClusterBackend(cluster, max_migrations=3)
    backend.start()
    moves: list[str] = []
    backend.on_migration = moves.append
    try:
        req = GenerateInput("poison", PROMPT, SamplingParams(max_tokens=4), "")
        deadline = time.monotonic() + 60
        while True:  # until all three workers registered and the request was placed
            try:
                async for _ in backend.generate(req):
                    pass
            except BackendUnavailableError as e:
                if "same way" in str(e) or time.monotonic() > deadline:
                    error = str(e)
                    break
            else:
                pytest.fail("the request that cannot meet its prefill deadline completed")
            moves.clear()
            await asyncio.sleep(0.2)
    finally:
        await backend.close()
    assert "failed the same way on two workers" in error, error
    assert "prefill_failed DEADLINE_EXCEEDED on p0, p1" in error or "on p1, p0" in error, error
    assert moves == ["prefill_failed"]  # one move, not three

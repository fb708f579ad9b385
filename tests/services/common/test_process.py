"""The process shell: JSON logs, the gRPC server's health and reflection, the READY line,
the SIGTERM drain (NOT_SERVING, then the service's drain within its deadline, then stop),
and the /metrics server, which keeps ``pdserve:`` names whatever format the scraper asks
for (prometheus_client's OpenMetrics output would rename the samples)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.parser import text_string_to_metric_families

from services.common import process
from tests.scrape import PROMETHEUS_ACCEPT
from tests.services.procs import REPO

SERVICE = "pdserve.v1.Test"


def test_logs_are_json_lines_on_stderr_with_service_and_pid() -> None:
    code = (
        "import structlog; from services.common.process import configure_logging;"
        "configure_logging('demo', 'INFO'); log = structlog.get_logger();"
        "log.debug('hidden'); log.info('shown', answer=42)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    event = json.loads(line)
    assert (event["event"], event["answer"], event["level"]) == ("shown", 42, "info")
    assert event["service"] == "demo" and isinstance(event["pid"], int)


async def _health(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        return reply.status


async def _listed_services(address: str) -> set[str]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for reply in stub.ServerReflectionInfo(iter([request]), timeout=5):
            return {s.name for s in reply.list_services_response.service}
    return set()


async def _ready_line(capsys: pytest.CaptureFixture[str]) -> str:
    for _ in range(500):
        for line in capsys.readouterr().out.splitlines():
            if line.startswith("READY "):
                return line
        await asyncio.sleep(0.01)
    raise AssertionError("no READY line")


async def test_sigterm_turns_health_off_before_the_drain_hook_then_stops(
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = process.GrpcServer([SERVICE], "127.0.0.1", 0)
    seen: list[int] = []

    async def on_drain() -> None:
        seen.append(await _health(server.address, SERVICE))

    task = asyncio.create_task(process.serve(
        server, role="test", drain_timeout_s=5.0, on_drain=on_drain, ready={"extra": "x"},
    ))  # fmt: skip
    assert await _ready_line(capsys) == f"READY test {server.address} extra=x"
    assert server.address == f"127.0.0.1:{server.port}"
    assert await _health(server.address) == health_pb2.HealthCheckResponse.SERVING
    assert await _health(server.address, SERVICE) == health_pb2.HealthCheckResponse.SERVING
    assert {SERVICE, "grpc.health.v1.Health"} <= await _listed_services(server.address)
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(task, 10)
    assert seen == [health_pb2.HealthCheckResponse.NOT_SERVING]
    with pytest.raises(grpc.aio.AioRpcError):
        await _health(server.address)  # stopped


async def test_a_drain_that_overruns_is_cut_at_the_deadline(
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = process.GrpcServer([SERVICE], "127.0.0.1", 0)
    task = asyncio.create_task(process.serve(
        server, role="test", drain_timeout_s=0.3, on_drain=lambda: asyncio.sleep(60),
    ))  # fmt: skip
    await _ready_line(capsys)
    t0 = time.monotonic()
    os.kill(os.getpid(), signal.SIGINT)
    await asyncio.wait_for(task, 10)
    assert time.monotonic() - t0 < 5


async def test_a_port_in_use_is_an_error() -> None:
    first = process.GrpcServer([SERVICE], "127.0.0.1", 0)
    await first.start()
    try:
        with pytest.raises(OSError, match="cannot bind"):
            process.GrpcServer([SERVICE], "127.0.0.1", first.port)
    finally:
        await first.stop(None)


def test_reachable_address() -> None:
    assert process.reachable("0.0.0.0") == "127.0.0.1"
    assert process.reachable("10.0.0.5") == "10.0.0.5"
    assert process.reachable("0.0.0.0", "worker-3") == "worker-3"


def test_samples_keep_their_colon_names_when_openmetrics_is_asked_for() -> None:
    registry = CollectorRegistry()
    Counter("pdserve:things", "d", ["role"], registry=registry).labels("decode").inc(3)
    Histogram("pdserve:wait_seconds", "d", registry=registry, buckets=(1.0,)).observe(0.5)
    server = process.serve_metrics("127.0.0.1", 0, registry)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        request = urllib.request.Request(url, headers={"Accept": PROMETHEUS_ACCEPT})
        with urllib.request.urlopen(request, timeout=5) as r:
            assert r.headers["Content-Type"].startswith("text/plain;")  # not OpenMetrics
            text = r.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    samples = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert {"pdserve:things_total", "pdserve:wait_seconds_bucket"} <= samples
    assert not any(name.startswith("pdserve_") for name in samples)

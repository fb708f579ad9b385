"""services.common.faults: a fault spec makes this process's internal gRPC calls fail on
purpose (tests, chaos)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common import cluster_auth, settings
from services.common.faults import FaultArgs, install_rpc_faults, rpc_fault_interceptors
from transfer.faults import FaultSpec


@pytest.fixture
def rpc_faults() -> Iterator[None]:
    install_rpc_faults(FaultSpec(rpc_fail_every=2))
    yield
    install_rpc_faults(None)


async def test_every_nth_internal_call_fails_unsent(rpc_faults) -> None:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with cluster_auth.channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            outcomes = []
            for _ in range(4):
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    outcomes.append("ok")
                except grpc.aio.AioRpcError as e:
                    assert e.code() is grpc.StatusCode.UNAVAILABLE
                    assert "injected fault" in (e.details() or "")
                    outcomes.append("failed")
            assert outcomes.count("failed") == 2 and outcomes.count("ok") == 2
            with pytest.raises(grpc.aio.AioRpcError, match="injected fault"):
                for _ in range(2):  # one of two server-streaming calls fails too
                    async for _ in stub.Watch(health_pb2.HealthCheckRequest(), timeout=0.5):
                        break
    finally:
        await server.stop(None)


def test_no_plan_adds_no_interceptor() -> None:
    assert rpc_fault_interceptors() == []


def test_production_comes_from_the_settings_and_refuses_an_unforced_plan(capsys) -> None:
    env = {"PDSERVE_FAULTS": "stall_ms=10"}
    assert settings.load(FaultArgs, "prefill", [], env).spec.stall_ms == 10
    for argv, extra in ((["--production"], {}), ([], {"PDSERVE_PRODUCTION": "1"})):
        with pytest.raises(SystemExit) as e:
            settings.load(FaultArgs, "prefill", argv, {**env, **extra})
        assert e.value.code == 2
        assert "refused in production" in capsys.readouterr().err
    forced = {"PDSERVE_FAULTS": "stall_ms=10,force=1", "PDSERVE_PRODUCTION": "1"}
    assert settings.load(FaultArgs, "prefill", [], forced).spec.stall_ms == 10

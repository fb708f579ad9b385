"""Internal authentication with real processes: a scheduler and a prefill worker that share
a cluster token refuse callers without it (UNAUTHENTICATED), a service without a token does
not start unless told --insecure-cluster, and the prefill worker writes KV only where a
placement token signed with the scheduler's own key lets it (PERMISSION_DENIED otherwise,
and the destination's bytes stay zero)."""

from __future__ import annotations

import asyncio
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.device import DTYPES
from engine.engine_config import EngineConfig
from engine.kv_cache import KVCacheSpec
from pdserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common import cluster_auth, placement_token
from services.common.cluster_auth import ClusterAuth
from services.common.convert import handle_to_proto
from tests.services.procs import ServiceProcess, start_service
from transfer.handle import KVLayout
from transfer.registry import get_transport

TOKEN = "cluster-token-for-tests"
ENV = {"PDSERVE_CLUSTER_TOKEN": TOKEN}
AUTH = ClusterAuth(token=TOKEN)
PROMPT = list(range(100, 120))  # 20 tokens: 2 blocks of 16
# The scheduler's placement signing key: the test holds it to mint tokens as the scheduler
# would; no worker has it.
SIGNING_KEY = Ed25519PrivateKey.generate()
PREFILL_ID = "prefill-test"


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "placement.pem"
    key_file.write_bytes(
        SIGNING_KEY.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    procs: dict[str, ServiceProcess] = {}
    try:
        procs["scheduler"] = start_service(
            "services.scheduler", "--grpc-host", "127.0.0.1", "--grpc-port", "0",
            "--metrics-port", "0", "--redis-url", "", "--placement-signing-key-file",
            str(key_file), env=ENV,
        )  # fmt: skip
        procs["prefill"] = start_service(
            "services.prefill", "--port", "0", "--kv-cache-mib", "16", "--transports", "shm",
            "--scheduler", procs["scheduler"].address, "--worker-id", PREFILL_ID, env=ENV,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not any('"registered"' in line for line in procs["prefill"].output):
            assert time.monotonic() < deadline, "the prefill worker did not register"
            time.sleep(0.1)
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def _scheduler_without_token(*flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "services.scheduler", "--grpc-port", "0", "--metrics-port", "0",
         "--redis-url", "", *flags],
        env={k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip


def test_a_service_without_a_cluster_token_refuses_to_start() -> None:
    """Fail closed: no token, no service (exit 2 naming the settings); an operator who
    means it says --insecure-cluster, and the process serves."""
    refused = _scheduler_without_token()
    _, err = refused.communicate(timeout=60)
    assert refused.returncode == 2, err[-2000:]
    assert "no cluster token" in err and "--insecure-cluster" in err
    insecure = _scheduler_without_token("--insecure-cluster")
    try:
        assert insecure.stdout is not None
        ready, _, _ = select.select([insecure.stdout], [], [], 60)
        assert ready, "no READY line within 60 s"
        assert insecure.stdout.readline().startswith("READY scheduler")
    finally:
        insecure.kill()
        _, err = insecure.communicate(timeout=10)
    assert "cluster_auth_off" in err


def _worker() -> common_pb2.WorkerInfo:
    return common_pb2.WorkerInfo(
        worker_id="decode-test",
        role=common_pb2.WORKER_ROLE_DECODE,
        grpc_address="127.0.0.1:1",
        capacity=common_pb2.WorkerCapacity(
            total_kv_blocks=8,
            block_size=16,
            max_num_seqs=1,
            max_model_len=64,
            max_num_batched_tokens=64,
        ),
    )


async def test_register_worker_without_the_token_is_unauthenticated(services) -> None:
    address = services["scheduler"].address
    request = scheduler_pb2.RegisterWorkerRequest(worker=_worker())
    async with grpc.aio.insecure_channel(address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await scheduler_pb2_grpc.SchedulerStub(ch).RegisterWorker(request, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "x-pdserve-cluster-token" in (e.value.details() or "")
        health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes stay open
    async with cluster_auth.channel(address, AUTH) as ch:
        reply = await scheduler_pb2_grpc.SchedulerStub(ch).RegisterWorker(request, timeout=5)
        assert reply.lease_ttl_ms > 0
    # the prefill worker registered through the same channel function, with the token
    assert any('"registered"' in line for line in services["prefill"].output)


async def test_prefill_without_the_token_is_unauthenticated(services) -> None:
    async with grpc.aio.insecure_channel(services["prefill"].address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await worker_pb2_grpc.PrefillWorkerStub(ch).Prefill(
                worker_pb2.PrefillRequest(request_id="r"), timeout=10
            )
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture
def regions(default_checkpoint):
    """Two KV regions of this process, laid out like the prefill worker's pool (shm)."""
    cfg = EngineConfig(device="cpu").resolved(role="prefill")
    spec = KVCacheSpec.for_model(
        default_checkpoint.config, num_blocks=4, block_size=cfg.block_size,
        dtype=DTYPES[cfg.kv_cache_dtype],
    )  # fmt: skip
    transport = get_transport("shm")
    try:
        yield [transport.register(KVLayout.from_spec(spec)) for _ in range(2)]
    finally:
        transport.close()


def _prefill_request(rid: str, region, token: str, attempt: int = 0) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(
        request_id=rid,
        attempt=attempt,
        prompt_token_ids=PROMPT,
        sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0),
        deadline_ms=30_000,
        decode_worker_id="decode-test",
        placement_token=token,
        kv_destination=worker_pb2.KVDestination(
            region=handle_to_proto(region.handle), block_ids=[0, 1]
        ),
    )


def _token(
    rid: str,
    region,
    key: Ed25519PrivateKey = SIGNING_KEY,
    ttl_s: float = 600,
    attempt: int = 0,
    prefill: str = PREFILL_ID,
) -> str:
    h = region.handle
    claims = placement_token.Claims(
        request_id=rid,
        attempt=attempt,
        decode_worker_id="decode-test",
        prefill_worker_id=prefill,
        region_digest=placement_token.region_digest(h.transport, h.address, h.region_id),
        expires_unix_s=time.time() + ttl_s,
    )
    return placement_token.mint(key, claims)


def _v1_token_keyed_by_the_cluster_token(rid: str, region) -> str:
    """What any holder of the cluster token could mint before tokens were the scheduler's
    alone: an HMAC keyed by a derivation of the cluster token."""
    import base64
    import hashlib
    import hmac
    import json

    h = region.handle
    key = hmac.new(TOKEN.encode(), b"pdserve placement-token v1", hashlib.sha256).digest()
    body = {"r": rid, "w": "decode-test", "e": time.time() + 600,
            "d": placement_token.region_digest(h.transport, h.address, h.region_id)}  # fmt: skip
    b64 = lambda b: base64.urlsafe_b64encode(b).rstrip(b"=").decode()  # noqa: E731
    signed = f"v1.{b64(json.dumps(body, separators=(',', ':')).encode())}"
    return f"{signed}.{b64(hmac.new(key, signed.encode(), hashlib.sha256).digest())}"


async def test_prefill_writes_only_where_the_scheduler_placed(services, regions) -> None:
    ours, other = regions
    refused = {
        "no placement token": "",
        # a worker (or anyone with the cluster token) signing its own: not the scheduler's
        "signature is invalid": _token("r1", ours, key=Ed25519PrivateKey.generate()),
        "malformed": _v1_token_keyed_by_the_cluster_token("r1", ours),
        "another KV region": _token("r1", other),
        "for request 'r0'": _token("r0", ours),
        "for prefill worker 'prefill-other'": _token("r1", ours, prefill="prefill-other"),
        "for attempt 1": _token("r1", ours, attempt=1),
        "expired": _token("r1", ours, ttl_s=-1),
    }
    async with cluster_auth.channel(services["prefill"].address, AUTH) as ch:
        stub = worker_pb2_grpc.PrefillWorkerStub(ch)
        for reason, token in refused.items():
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Prefill(_prefill_request("r1", ours, token), timeout=30)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, reason
            assert reason in (e.value.details() or ""), e.value.details()
        await asyncio.sleep(0.3)  # nothing still in flight lands later either
        assert not ours.tensor.any(), "a refused prefill wrote into the destination"
        # the guard's counterpart: the scheduler's token for this very region is honoured
        reply = await stub.Prefill(_prefill_request("r1", ours, _token("r1", ours)), timeout=60)
    assert reply.kv_transfer_bytes > 0 and ours.tensor.any()
    assert not other.tensor.any()

"""services.common.cluster_auth over a real in-process gRPC server: a call without the
cluster token is UNAUTHENTICATED, a call through ``channel`` passes, health stays open;
settings and files are read the one way every service shares."""

from __future__ import annotations

import shutil

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common import cluster_auth, settings
from services.common.cluster_auth import ClusterAuth, ClusterAuthArgs
from services.common.process import GrpcServer

TOKEN = "s3cret-token"


class Echo(scheduler_pb2_grpc.SchedulerServicer):
    """A scheduler that answers every Deregister (unary) call: the guard is in front."""

    def __init__(self) -> None:
        self.calls = 0

    async def DeregisterWorker(self, request, context):
        self.calls += 1
        return scheduler_pb2.DeregisterWorkerReply()


async def _server(auth: ClusterAuth) -> tuple[GrpcServer, Echo]:
    server = GrpcServer(["pdserve.v1.Scheduler"], "127.0.0.1", 0, auth=auth)
    echo = Echo()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(echo, server.server)
    await server.start()
    return server, echo


async def _deregister(ch: grpc.aio.Channel, metadata=None) -> None:
    stub = scheduler_pb2_grpc.SchedulerStub(ch)
    await stub.DeregisterWorker(
        scheduler_pb2.DeregisterWorkerRequest(worker_id="w"), timeout=5, metadata=metadata
    )


async def test_calls_without_the_token_are_unauthenticated_and_never_run() -> None:
    server, echo = await _server(ClusterAuth(token=TOKEN))
    try:
        async with grpc.aio.insecure_channel(server.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _deregister(ch)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "missing x-pdserve-cluster-token" in (e.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _deregister(ch, ((cluster_auth.TOKEN_METADATA_KEY, "s3cret-tokeN"),))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "wrong x-pdserve-cluster-token" in (e.value.details() or "")
            assert echo.calls == 0
            # health stays open: probes carry no token
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        async with cluster_auth.channel(server.address, ClusterAuth(token=TOKEN)) as ch:
            await _deregister(ch)
            await _deregister(ch, (("x-other", "kept"),))  # the caller's metadata travels too
        assert echo.calls == 2
    finally:
        await server.stop(None)


async def test_without_a_token_the_server_is_open() -> None:
    server, echo = await _server(ClusterAuth())
    try:
        async with cluster_auth.channel(server.address, ClusterAuth()) as ch:
            await _deregister(ch)
        assert echo.calls == 1
    finally:
        await server.stop(None)


def test_the_token_comes_from_a_file_or_the_shared_variable(tmp_path) -> None:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    for service in ("scheduler", "decode"):
        args = settings.load(
            ClusterAuthArgs, service, [], {"PDSERVE_CLUSTER_TOKEN_FILE": str(path)}
        )
        assert cluster_auth.load(args).token == TOKEN
        args = settings.load(ClusterAuthArgs, service, [], {"PDSERVE_CLUSTER_TOKEN": TOKEN})
        assert cluster_auth.load(args).token == TOKEN
    with pytest.raises(ValueError, match=r"no cluster token.*--insecure-cluster"):
        cluster_auth.load(ClusterAuthArgs())  # fail closed
    assert cluster_auth.load(ClusterAuthArgs(insecure_cluster=True)).token is None
    with pytest.raises(ValueError, match="contradict"):
        ClusterAuthArgs(insecure_cluster=True, cluster_token=TOKEN)
    assert TOKEN not in repr(cluster_auth.load(ClusterAuthArgs(cluster_token=TOKEN)))
    with pytest.raises(ValueError, match="cannot read the cluster token file"):
        cluster_auth.load(ClusterAuthArgs(cluster_token_file=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="one way"):
        ClusterAuthArgs(cluster_token_file=str(path), cluster_token=TOKEN)
    with pytest.raises(ValueError, match="go together"):
        ClusterAuthArgs(cluster_tls_cert=str(path))


def _pki(tmp_path) -> dict[str, bytes]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate (openssl)."""
    import subprocess

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "1", "-subj", "/CN=pdserve-test-ca")  # fmt: skip
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
            f"{name}.csr", "-subj", f"/CN={name}")  # fmt: skip
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "1",
            "-extfile", "san.ext")  # fmt: skip
    return {p.name: p.read_bytes() for p in tmp_path.iterdir()}


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_mutual_tls_with_the_token(tmp_path) -> None:
    pki = _pki(tmp_path)
    server_auth = ClusterAuth(
        token=TOKEN, cert=pki["server.pem"], key=pki["server.key"], ca=pki["ca.pem"]
    )
    server, echo = await _server(server_auth)
    try:
        client = ClusterAuth(
            token=TOKEN, cert=pki["client.pem"], key=pki["client.key"], ca=pki["ca.pem"]
        )
        async with cluster_auth.channel(server.address, client) as ch:
            await _deregister(ch)
        assert echo.calls == 1
        no_cert = ClusterAuth(token=TOKEN, ca=pki["ca.pem"])  # TLS, but no client certificate
        async with cluster_auth.channel(server.address, no_cert) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _deregister(ch)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake fails
        async with grpc.aio.insecure_channel(server.address) as ch:  # plaintext: refused
            with pytest.raises(grpc.aio.AioRpcError):
                await _deregister(ch)
        assert echo.calls == 1
    finally:
        await server.stop(None)

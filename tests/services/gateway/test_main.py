"""The gateway as a process: ``--help``, start-up, and a SIGTERM drain that lets an
in-flight stream finish before exiting 0."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.services.procs import REPO, start_service

MAX_TOKENS = 24


def test_help_lists_flags_and_env_prefix() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.gateway", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for flag in ("--http-port", "--grpc-port", "--max-body-bytes", "--drain-timeout-s"):
        assert flag in done.stdout
    assert "PDSERVE_GATEWAY_" in done.stdout


async def _health_refused(base: str) -> bool:
    """True once /health stops answering 200 (503 while draining, or refused)."""
    for _ in range(100):
        try:
            async with aiohttp.ClientSession() as s, s.get(base + "/health") as r:
                if r.status != 200:
                    return True
        except aiohttp.ClientError:
            return True
        await asyncio.sleep(0.02)
    return False


async def test_sigterm_drains_in_flight_stream_then_exits() -> None:
    sp = start_service(
        "services.gateway",
        *("--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0"),
        *("--served-model-name", "smol", "--kv-cache-mib", "16", "--max-model-len", "256"),
        *("--drain-timeout-s", "30", "--threads", "1"),
    )
    try:
        ready = sp.ready_line
        assert ready.startswith("READY gateway")
        grpc_addr = ready.split()[3].removeprefix("grpc=")
        base = f"http://{sp.address}"
        async with grpc.aio.insecure_channel(grpc_addr) as ch:
            reply = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=10
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

        body = {
            "model": "smol",
            "prompt": "Once upon a time",
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with (
            aiohttp.ClientSession() as s,
            s.post(base + "/v1/completions", json=body) as r,
        ):
            assert r.status == 200
            first = await r.content.readline()
            assert first.startswith(b"data: {")
            sp.proc.send_signal(signal.SIGTERM)  # mid-stream
            assert await _health_refused(base)
            rest = (await r.read()).decode()
        frames = [f for f in (first.decode() + rest).split("\n\n") if f]
        assert frames[-1] == "data: [DONE]"
        usage = json.loads(frames[-2].removeprefix("data: "))["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS  # the stream ran to its end

        assert sp.proc.wait(30) == 0
        logs = [json.loads(line) for line in sp.output if line.startswith("{")]
        events = [e["event"] for e in logs]
        assert events.index("draining") < events.index("stopped")
        assert {e["service"] for e in logs} == {"gateway"}
        started = next(e for e in logs if e["event"] == "completion_started")
        assert started["request_id"].startswith("cmpl-")
    finally:
        sp.kill()

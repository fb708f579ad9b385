"""Admission in cluster mode, through ``pdserve up``'s launcher: the gateway process runs the
cluster backend (scheduler + a colocated worker), and its cap, queue and size check refuse
exactly as the local backend's tests show (test_admission_edges.py). Slow: real processes."""

from __future__ import annotations

import time

import aiohttp
import grpc
import pytest

from pdserve.v1 import gateway_pb2, gateway_pb2_grpc
from services.launcher import Stack, free_port
from services.up import launch, load_up_config

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    args = load_up_config(
        ["--colocated", "--kv-store-segment-mib", "0", "--kv-cache-mib", "32",
         "--http-port", str(free_port()), "--grpc-port", str(free_port())], {}
    )  # fmt: skip
    env = {"PDSERVE_GATEWAY_MAX_CONCURRENT_REQUESTS": "1",
           "PDSERVE_GATEWAY_MAX_QUEUED_REQUESTS": "0"}  # fmt: skip
    st = Stack(log_dir=tmp_path_factory.mktemp("stack"), env=env)
    try:
        yield launch(args, st)
    finally:
        st.stop()


async def test_the_cluster_gateway_caps_and_refuses_oversized_prompts_at_once(stack) -> None:
    base = stack["http"]
    async with aiohttp.ClientSession() as http:
        async with http.get(base + "/models") as r:
            model = (await r.json())["data"][0]["id"]
        long = {"model": model, "prompt": "Count:", "max_tokens": 400, "ignore_eos": True,
                "stream": True}  # fmt: skip
        async with http.post(base + "/completions", json=long) as busy:
            assert busy.status == 200
            await busy.content.readline()  # the one slot is taken
            short = {"model": model, "prompt": "Hi", "max_tokens": 2}
            async with http.post(base + "/completions", json=short) as r:
                assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
                assert "limit of 1 concurrent requests" in (await r.json())["error"]["message"]
            async with grpc.aio.insecure_channel(stack["grpc"]) as ch:
                stub = gateway_pb2_grpc.GatewayStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    req = gateway_pb2.GenerateRequest(model=model, prompt="Hi")
                    [ev async for ev in stub.Generate(req, timeout=60)]
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # refused by its size alone, while the slot is taken: no queue, no tokenizer
            huge = {"model": model, "messages": [{"role": "user", "content": "word " * (3 << 18)}]}
            async with http.post(base + "/chat/completions", json=huge) as r:
                assert r.status == 400
                assert (await r.json())["error"]["code"] == "context_length_exceeded"
        # the slot is free again once the busy stream is gone
        deadline = time.monotonic() + 60
        while True:
            async with http.post(base + "/completions", json=short) as r:
                if r.status == 200 or time.monotonic() > deadline:
                    break
        assert r.status == 200

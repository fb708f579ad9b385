"""Admission by the ITL target, end to end: redis-server, the scheduler, a prefill and a
decode worker and the gateway as real processes (``pdserve up``'s launcher), the real model.

The decode worker's target (``--itl-target-ms 1``) is below any decode step, so its batch
target is 1: it runs one sequence at a time. The scheduler tells the gateway so with every
placement, the gateway's cap becomes 1 (its queue is 2 here), and more concurrent streams
than that are all served: one runs, two wait in the gateway's queue, the rest get 429 with
Retry-After and come back; none fails, and the worker's batch never holds two.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import aiohttp
import pytest

from services.launcher import Stack, free_port
from services.up import launch, load_up_config
from tests.scrape import metric, metric_in

pytestmark = pytest.mark.asyncio

STREAMS = 6
MAX_TOKENS = 8
BODY = {"prompt": "The three primary colors are", "max_tokens": MAX_TOKENS,
        "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    args = load_up_config(
        ["--prefill", "1", "--decode", "1", "--itl-target-ms", "1", "--kv-cache-mib", "32",
         "--kv-store-segment-mib", "0", "--local-prefill-max-tokens", "0",
         "--http-port", str(free_port()), "--grpc-port", "0"], {}
    )  # fmt: skip
    env = {"PDSERVE_GATEWAY_MAX_QUEUED_REQUESTS": "2"}
    st = Stack(log_dir=tmp_path_factory.mktemp("itl-admission"), env=env)
    try:
        yield launch(args, st)
    finally:
        st.stop()


async def _stream(http: aiohttp.ClientSession, url: str, model: str) -> tuple[str, int]:
    """One request, sent again after each 429 as its Retry-After says: its text and how
    many 429s it met. Anything but 200 or 429 fails the test."""
    refused = 0
    deadline = time.monotonic() + 45
    while True:
        async with http.post(url, json={**BODY, "model": model}) as r:
            if r.status == 429:
                refused += 1
                assert int(r.headers["Retry-After"]) >= 1
                assert time.monotonic() < deadline, "still refused after 45 s"
                await asyncio.sleep(float(r.headers["Retry-After"]))
                continue
            assert r.status == 200, await r.text()
            text, reason = "", None
            async for line in r.content:
                if line.startswith(b"data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    reason = choice["finish_reason"] or reason
            assert reason == "length"
            return text, refused


async def test_streams_beyond_the_batch_target_wait_or_come_back_and_all_are_served(
    stack,
) -> None:
    decode, gateway = stack["metrics:decode-0"], stack["gateway-metrics"]
    assert metric(decode, "pdserve:itl_target_seconds") == pytest.approx(0.001)
    assert metric(decode, "pdserve:target_batch_size") == 1
    url = stack["http"] + "/completions"
    async with aiohttp.ClientSession() as http:
        async with http.get(stack["http"] + "/models") as r:
            model = (await r.json())["data"][0]["id"]
        # one placement tells the gateway the fleet's target batch: its cap follows
        alone, refused = await _stream(http, url, model)
        assert refused == 0
        assert metric(gateway, "pdserve:max_concurrent_requests") == 1
        results = await asyncio.wait_for(
            asyncio.gather(*(_stream(http, url, model) for _ in range(STREAMS))), 60
        )
    assert [text for text, _ in results] == [alone] * STREAMS  # greedy: the same answer
    # 1 runs, 2 wait in the gateway's queue, the rest came back after a 429
    assert sum(refused for _, refused in results) >= STREAMS - 3
    assert metric(gateway, "pdserve:requests_refused_total", 'reason="overloaded"') >= 1
    # the worker never ran two sequences in one step, and refused no reservation: the
    # excess waited at the gateway, not on the worker
    steps = metric(decode, "pdserve:engine_step_batch_size_count")
    assert steps >= (STREAMS + 1) * (MAX_TOKENS - 1)
    assert metric(decode, "pdserve:engine_step_batch_size_bucket", 'le="1.0"') == steps
    scrape = urllib.request.urlopen(decode, timeout=5).read().decode()
    assert metric_in(scrape, "pdserve:request_errors_total", absent=0.0) == 0

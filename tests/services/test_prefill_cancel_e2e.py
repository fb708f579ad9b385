"""A client that leaves while its long prompt is being prefilled on another worker costs a
small share of that prefill: real prefill and decode workers over real gRPC, the default
model, KV over shm and tcp.

The decode worker cancels its Prefill call with the request; the prefill worker computes
the prompt in chunks of ``--prefill-token-budget`` tokens and stops before the next one.
Its ``pdserve:prompt_tokens_computed_total`` counts what it computed. The decode worker's
blocks stay fenced until the KV lease ends (no reply says when a cancelled call's writer
stopped), then every block on both workers is free and the pair serves on.
"""

from __future__ import annotations

import asyncio

import pytest

from engine.sampling_params import SamplingParams
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common import cluster_auth
from services.launcher import free_port
from tests.scrape import metric
from tests.services.procs import ServiceProcess, start_unscheduled

CHUNK = 256  # the prefill worker's --prefill-token-budget
PROMPT_TOKENS = 4096
# Long enough for the whole prompt in one pass on a loaded 2-core host (the code before
# chunking had to finish it to count it); with 2 s of grace, the KV lease of a cancel.
PREFILL_DEADLINE_S = 20.0
LEASE_S = PREFILL_DEADLINE_S + 2.0
TOKENS = 8


@pytest.fixture(scope="module")
def workers():
    """Decode workers over shm and tcp, and a prefill worker computing in chunks."""
    procs: dict[str, ServiceProcess] = {}
    ports: dict[str, int] = {}
    try:
        for transport in ("shm", "tcp"):
            ports[transport] = free_port()
            procs[transport] = start_unscheduled(
                "services.decode", "--port", "0", "--transport", transport,
                "--kv-cache-mib", "160", "--prefill-deadline-s", str(PREFILL_DEADLINE_S),
                "--metrics-port", str(ports[transport]),
            )  # fmt: skip
        ports["prefill"] = free_port()
        procs["prefill"] = start_unscheduled(
            "services.prefill", "--port", "0", "--kv-cache-mib", "160",
            "--prefill-token-budget", str(CHUNK), "--metrics-port", str(ports["prefill"]),
        )  # fmt: skip
        yield procs, ports
    finally:
        for p in procs.values():
            p.stop()


def _metric(port: int, name: str, labels: str = "") -> float:
    return metric(f"http://127.0.0.1:{port}/metrics", name, labels)


async def _until(port: int, name: str, want: float, timeout: float, labels: str = "") -> float:
    """``name``'s value once it is ``want``, or when ``timeout`` seconds passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        v = _metric(port, name, labels)
        if v == want or loop.time() > deadline:
            return v
        await asyncio.sleep(0.1)


def _request(rid: str, ids: list[int], prefill: str) -> worker_pb2.DecodeGenerateRequest:
    return worker_pb2.DecodeGenerateRequest(
        request_id=rid,
        prompt_token_ids=ids,
        sampling=common_pb2.SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True),
        prefill_address=prefill,
    )


def _long_prompt(tokenizer, log: str) -> list[int]:
    """About 3,000 words; ``log`` heads it, so no worker holds another test's prefix."""
    text = f"The {log} harbour log. " + " ".join(
        f"Entry {i}: the harbour master logged the {['schooner', 'ketch', 'barge'][i % 3]} "
        f"that came in at {i % 24} o'clock with {7 + i % 11} crates of cargo for the market."
        for i in range(400)
    )
    ids = tokenizer.encode(text)
    assert len(ids) >= PROMPT_TOKENS
    return ids[:PROMPT_TOKENS]


@pytest.fixture(scope="module")
def short_prompt(default_tokenizer) -> list[int]:
    return default_tokenizer.encode("Name three rivers of Europe and the seas they reach.")


@pytest.fixture(scope="module")
def expected_short(make_engine, short_prompt) -> list[int]:
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    return make_engine().generate([short_prompt], params)[0].token_ids


# tcp under -m slow: the default suite keeps one transport of this 20-second test
@pytest.mark.parametrize("transport", ["shm", pytest.param("tcp", marks=pytest.mark.slow)])
async def test_a_client_gone_after_half_a_second_costs_a_small_share_of_its_prefill(
    workers, default_tokenizer, short_prompt, expected_short, transport
) -> None:
    procs, ports = workers
    long_prompt = _long_prompt(default_tokenizer, transport)
    dec, pre = procs[transport], procs["prefill"]
    computed = "pdserve:prompt_tokens_computed_total"
    before = _metric(ports["prefill"], computed)
    leased = _metric(ports[transport], "pdserve:kv_fences_total", 'how="lease"')
    async with cluster_auth.channel(dec.address) as ch:
        call = worker_pb2_grpc.DecodeWorkerStub(ch).Generate(
            _request(f"gone-{transport}", long_prompt, pre.address), timeout=120
        )
        await asyncio.sleep(0.5)
        call.cancel()
    await asyncio.sleep(0.5)
    # The reserved blocks are fenced: the cancelled call's writer may still write.
    assert _metric(ports[transport], "pdserve:kv_cache_usage_perc") > 0.0

    # The prefill worker's blocks come back once its aborted transfer's outcome is in. The
    # prompt stopped after the chunk under way when the cancel came (and perhaps the next):
    # a small share of it, where the code before computed it all.
    assert await _until(ports["prefill"], "pdserve:kv_cache_usage_perc", 0.0, LEASE_S) == 0.0
    spent = _metric(ports["prefill"], computed) - before
    print(f"cancelled after 0.5 s: computed {spent:.0f} of {len(long_prompt)} prompt tokens")
    assert spent <= len(long_prompt) / 4

    # The decode worker's come back when the KV lease ends.
    assert await _until(ports[transport], "pdserve:kv_cache_usage_perc", 0.0, LEASE_S + 10) == 0.0
    assert _metric(ports[transport], "pdserve:kv_fences_total", 'how="lease"') == leased + 1

    # and the pair serves the next request, greedy as the colocated engine
    async with cluster_auth.channel(dec.address) as ch:
        toks: list[int] = []
        stream = worker_pb2_grpc.DecodeWorkerStub(ch).Generate(
            _request(f"after-{transport}", short_prompt, pre.address), timeout=120
        )
        async for ev in stream:
            toks.extend(ev.token_ids)
    assert toks == expected_short

"""KV fencing with real processes, over every transport that writes into a decode worker's
host pool (shm, tcp; mooncake under -m slow): a destination block is reused only once no
byte of its writer can land any more, and cancelling a request at any point of its life
leaves every block free on both workers.

The prefill worker runs a fault spec that freezes each transfer's writer for a while right
before it moves bytes (``stall_ms``: what a descheduled or stopped writer does), so a
request cancelled meanwhile has a writer that will still write when it wakes: the late
write that fencing must keep out of any block given to another request.
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

STALL_MS = 2000
TOKENS = 40


# mooncake under -m slow: its five cases each wait out a KV lease (~13 s); the default
# suite keeps the fence on shm and tcp, and mooncake transfers in test_workers_e2e.py
TRANSPORTS = ["shm", "tcp", pytest.param("mooncake", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=TRANSPORTS)
def workers(request):
    """A decode worker whose pool prefill workers write over the transport of the param,
    and a prefill worker whose writers freeze before they move a job's bytes."""
    procs: dict[str, ServiceProcess] = {}
    ports = {"decode": free_port(), "prefill": free_port()}
    try:
        procs["decode"] = start_unscheduled(
            "services.decode", "--port", "0", "--transport", request.param,
            "--mooncake-protocol", "tcp", "--kv-cache-mib", "32", "--prefill-deadline-s", "8",
            "--metrics-port", str(ports["decode"]),
        )  # fmt: skip
        procs["prefill"] = start_unscheduled(
            "services.prefill", "--port", "0", "--kv-cache-mib", "48",
            "--transports", "shm,tcp,mooncake", "--metrics-port", str(ports["prefill"]),
            "--faults", f"stall_ms={STALL_MS}",
        )  # fmt: skip
        yield procs, ports
    finally:
        for p in procs.values():
            p.stop()


def _metric(port: int, name: str, labels: str = "") -> float:
    return metric(f"http://127.0.0.1:{port}/metrics", name, labels)


async def _until_free(port: int, timeout: float) -> float:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        usage = _metric(port, "pdserve:kv_cache_usage_perc")
        if usage == 0.0 or asyncio.get_running_loop().time() > deadline:
            return usage
        await asyncio.sleep(0.05)


def _request(rid: str, ids: list[int], prefill: str = "", max_tokens: int = TOKENS):
    return worker_pb2.DecodeGenerateRequest(
        request_id=rid,
        prompt_token_ids=ids,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        prefill_address=prefill,
    )


async def _generate(address: str, req) -> list[int]:
    async with cluster_auth.channel(address) as ch:
        toks: list[int] = []
        async for ev in worker_pb2_grpc.DecodeWorkerStub(ch).Generate(req, timeout=120):
            toks.extend(ev.token_ids)
        return toks


@pytest.fixture(scope="module")
def prompts(default_tokenizer) -> dict[str, list[int]]:
    tok = default_tokenizer
    a = tok.encode("Tell me a story about a lighthouse keeper and a storm at sea.")
    b = tok.encode("Explain how a steam engine turns heat into motion, step by step.")
    n = min(len(a), len(b))
    return {"a": a[:n], "b": b[:n]}  # the same length: B takes exactly A's blocks


@pytest.fixture(scope="module")
def expected_b(make_engine, prompts) -> list[int]:
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    return make_engine().generate([prompts["b"]], params)[0].token_ids


async def test_a_late_write_never_reaches_a_reallocated_block(workers, prompts, expected_b):
    """A is cancelled while its writer is frozen; B, computed on the decode worker itself,
    comes right after and would be given A's blocks (freed blocks are reused first). The
    writer wakes and writes A's KV where A's blocks were. B's tokens must be B's own: A's
    blocks stay set aside until the writer is known to have stopped: the cancel cancels the
    Prefill call, so no reply says so, and the KV lease ends it."""
    procs, ports = workers
    dec, pre = procs["decode"], procs["prefill"]
    before = _metric(ports["decode"], "pdserve:kv_fences_total", 'how="lease"')
    async with cluster_auth.channel(dec.address) as ch:
        call = worker_pb2_grpc.DecodeWorkerStub(ch).Generate(
            _request("late-a", prompts["a"], pre.address), timeout=60
        )
        await asyncio.sleep(0.6)  # A is computed; its writer is frozen before it moves bytes
        call.cancel()
    await asyncio.sleep(1.2)  # past the old 1 s grace, before the writer wakes
    toks = await _generate(dec.address, _request("late-b", prompts["b"]))
    assert toks == expected_b
    # A's blocks came back when the KV lease (the 8 s deadline + 2 s) ended.
    assert await _until_free(ports["decode"], 8 + 2 + 5) == 0.0
    after = _metric(ports["decode"], "pdserve:kv_fences_total", 'how="lease"')
    assert after - before == 1


@pytest.mark.parametrize("point", ["queued", "computing", "transferring", "decoding"])
async def test_cancel_at_every_point_frees_every_block(
    workers, prompts, default_tokenizer, point
) -> None:
    procs, ports = workers
    dec, pre = procs["decode"], procs["prefill"]
    long_ids = default_tokenizer.encode("Describe the ocean in great detail. " * 40)
    loads: list[asyncio.Future[list[int]]] = []
    if point == "queued":  # a long prompt ahead keeps the prefill engine busy
        loads.append(
            asyncio.ensure_future(_generate(dec.address, _request("ahead", long_ids, pre.address)))
        )
        await asyncio.sleep(0.2)
    ids = long_ids if point == "computing" else prompts["a"]
    wait = {"queued": 0.1, "computing": 0.3, "transferring": 0.8}.get(point)
    async with cluster_auth.channel(dec.address) as ch:
        call = worker_pb2_grpc.DecodeWorkerStub(ch).Generate(
            _request(f"cancel-{point}", ids, pre.address, max_tokens=200), timeout=60
        )
        if wait is None:  # decoding: cancel after a few tokens
            n = 0
            async for _ in call:
                n += 1
                if n == 3:
                    break
        else:
            await asyncio.sleep(wait)
        call.cancel()
    for load in loads:
        await load
    # Every block comes back on both workers: the decode worker's once the writer stopped
    # (at most the KV lease: the 8 s prefill deadline + 2 s grace), the prefill worker's once
    # its transfer's outcome came in.
    assert await _until_free(ports["decode"], 8 + 2 + 5) == 0.0
    assert await _until_free(ports["prefill"], 8 + 2 + 5) == 0.0
    # and the pair serves the next request correctly
    toks = await _generate(dec.address, _request(f"after-{point}", prompts["b"], pre.address))
    assert len(toks) == TOKENS

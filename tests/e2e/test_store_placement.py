"""A prefix the scheduler's store index lists but the KV store no longer holds is never
computed on the decode worker: real processes (``pdserve up``'s launcher: redis-server, the
store's mooncake_master, the scheduler, a prefill and a decode worker, the gateway), the real
model, the official ``openai`` client.

Document A is served (the prefill worker puts its blocks in the store; the scheduler's index
lists them), then documents B and C, which push A out of both pools. The store is then
emptied behind everyone's back (what eviction does). A's revisit looks cheap to the scheduler
("the store" holds it): it places a short local prefill on the decode worker, which finds
the store short, and sends the prompt to the fallback prefill worker instead. Without that
check the decode worker computed the whole prompt itself.
"""

from __future__ import annotations

import time

import openai
import pytest

from services.launcher import Stack, free_port
from services.up import launch, load_up_config
from tests.scrape import metric

LIMIT = 32  # --local-prefill-max-tokens
BS = 16


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    args = load_up_config(
        ["--prefill", "1", "--decode", "1", "--kv-cache-mib", "24",
         "--kv-store-segment-mib", "64", "--local-prefill-max-tokens", str(LIMIT),
         "--http-port", str(free_port()), "--grpc-port", str(free_port())], {}
    )  # fmt: skip
    st = Stack(log_dir=tmp_path_factory.mktemp("store-placement"))
    try:
        yield launch(args, st)
    finally:
        st.stop()


def _document(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(n)]


def _empty_the_store(master: str) -> None:
    """Drop every object (a client of its own that lends no memory)."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) == 0
    try:
        client.remove_all()
    finally:
        client.close()


def _wait_for(url: str, name: str, at_least: float, labels: str = "") -> None:
    deadline = time.monotonic() + 30.0
    while metric(url, name, labels) < at_least:
        assert time.monotonic() < deadline, f"{name}{{{labels}}} < {at_least} at {url}"
        time.sleep(0.2)


async def test_a_stale_store_index_sends_the_revisit_to_a_prefill_worker(stack) -> None:
    endpoints = stack
    decode, prefill = endpoints["metrics:decode-0"], endpoints["metrics:prefill-0"]
    client = openai.AsyncOpenAI(base_url=endpoints["http"], api_key="unused", max_retries=0)
    model = (await client.models.list()).data[0].id
    computed = 'role="decode"'

    async def ask(prompt: list[int]) -> None:
        before = metric(decode, "pdserve:prompt_tokens_computed_total", computed)
        out = await client.completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0.0
        )
        assert out.choices[0].finish_reason in ("length", "stop")
        spent = metric(decode, "pdserve:prompt_tokens_computed_total", computed) - before
        assert spent <= LIMIT, f"the decode worker computed {spent} prompt tokens"

    _wait_for(prefill, "pdserve:kv_store_connected", 1)
    _wait_for(decode, "pdserve:kv_store_connected", 1)
    pool = int(metric(decode, "pdserve:kv_free_blocks"))  # idle: every block is free
    # A takes a third of a pool; B and C, half of one each: C evicts A (least recent)
    doc_a = _document(1, pool // 3 * BS)
    others = [_document(seed, (pool // 2 - 2) * BS) for seed in (2, 3)]
    await ask(doc_a)
    _wait_for(prefill, "pdserve:kv_store_stored_blocks_total", len(doc_a) // BS)
    for doc in others:
        await ask(doc)
    time.sleep(1.5)  # a heartbeat or two: the index lists every block put so far
    _empty_the_store(endpoints["kv-store"])

    await ask(doc_a)  # placed local on a stale index: the decode worker reroutes it
    assert metric(decode, "pdserve:local_prefill_reroutes_total") == 1
    assert metric(decode, "pdserve:kv_store_absent_blocks_total") >= 1
    # the prefill worker computed A again and stored it again: a second revisit loads it
    _wait_for(prefill, "pdserve:kv_store_stored_blocks_total", 2 * (len(doc_a) // BS))
    time.sleep(1.5)
    await ask(doc_a)
    assert metric(decode, "pdserve:local_prefill_reroutes_total") == 1

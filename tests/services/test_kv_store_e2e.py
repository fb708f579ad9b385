"""The KV store across real worker processes: a prefix prefill worker A computed is loaded,
not computed, by prefill worker B, and by A itself after A is killed and restarted.

A real ``mooncake_master``; prefill workers A and B and a decode worker, each lending 64 MiB
of DRAM to the store (every block kept twice, in distinct segments: it outlives one
worker). The tokens of a request whose prefix was loaded equal, token for token, those of
the same prompt served from A's own prefix cache (the same bytes, the same computation of
the rest); the workers' metrics count the loaded blocks and the tokens computed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvstore.master_process import MooncakeMaster
from tests.scrape import metric
from tests.services.procs import ServiceProcess, start_unscheduled
from tests.services.test_workers_e2e import _free_port, _generate, _request

KV_MIB = "48"
BS = 16


@pytest.fixture(scope="module")
def master() -> Iterator[MooncakeMaster]:
    m = MooncakeMaster.start()
    yield m
    m.stop()


def _store_flags(master: MooncakeMaster) -> list[str]:
    return ["--kv-store", master.address, "--kv-store-segment-mib", "64"]


def _prefill(master: MooncakeMaster, metrics_port: int) -> ServiceProcess:
    return start_unscheduled(
        "services.prefill", "--port", "0", "--kv-cache-mib", KV_MIB,
        "--metrics-port", str(metrics_port), *_store_flags(master),
    )  # fmt: skip


@pytest.fixture(scope="module")
def workers(master: MooncakeMaster) -> Iterator[dict[str, tuple[ServiceProcess, int]]]:
    procs: dict[str, tuple[ServiceProcess, int]] = {}
    try:
        for name in ("a", "b"):
            port = _free_port()
            procs[name] = (_prefill(master, port), port)
        port = _free_port()
        decode = start_unscheduled(
            "services.decode", "--port", "0", "--kv-cache-mib", KV_MIB, "--transport", "shm",
            "--metrics-port", str(port), *_store_flags(master),
        )  # fmt: skip
        procs["decode"] = (decode, port)
        for name in procs:
            _wait(procs[name][1], "pdserve:kv_store_connected", 1)
        yield procs
    finally:
        for proc, _ in procs.values():
            proc.stop()


def _metric(port: int, name: str) -> float:
    return metric(f"http://127.0.0.1:{port}/metrics", name)


def _wait(port: int, name: str, at_least: float, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    while (value := _metric(port, name)) < at_least and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


@pytest.fixture(scope="module")
def prompt(default_tokenizer) -> list[int]:
    text = f"[{time.time_ns()}] " + " ".join(
        f"Clause {i}: the tenant keeps the garden, the fence and gate {i} in good repair."
        for i in range(14)
    )
    tok = default_tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


async def test_a_prefix_worker_a_computed_is_loaded_by_b_and_by_a_after_a_restart(
    workers, prompt, master
) -> None:
    (a, a_port), (b, b_port) = workers["a"], workers["b"]
    decode = workers["decode"][0]
    full = (len(prompt) - 1) // BS  # the prefix blocks a prompt can reuse
    assert full >= 8

    _, first = await _generate(decode.address, _request("r-a", prompt, a.address))
    assert first.usage.prompt_tokens == len(prompt)
    assert _metric(a_port, "pdserve:prompt_tokens_computed_total") == len(prompt)
    stored = _wait(a_port, "pdserve:kv_store_stored_blocks_total", len(prompt) // BS)
    assert stored == len(prompt) // BS
    # A again: its own cache serves the prefix; B and A restarted load the same bytes.
    # (Against computing it all, tokens may part at a near-tie on some CPUs: the rest is a
    # product of another shape. tests/kvstore/test_store.py checks that with the logits.)
    computed, _ = await _generate(decode.address, _request("r-a-hit", prompt, a.address))

    loaded, last = await _generate(decode.address, _request("r-b", prompt, b.address))
    assert loaded == computed
    assert _metric(b_port, "pdserve:kv_store_hit_blocks_total") == full
    assert _metric(b_port, "pdserve:prompt_tokens_computed_total") == len(prompt) - full * BS
    assert _metric(b_port, "pdserve:kv_store_refused_blocks_total") == 0
    assert last.usage.cached_tokens == full * BS  # what the request did not compute

    # kill -9 A: the blocks in its segment die with it, their copies elsewhere do not.
    killed = time.monotonic()
    a.kill()
    a.stack.stop(grace=1.0)
    a_port = _free_port()
    a = _prefill(master, a_port)
    workers["a"] = (a, a_port)
    assert _wait(a_port, "pdserve:kv_store_connected", 1) == 1
    # The master forgets a dead client's segment after its TTL (kvstore.master.CLIENT_TTL_S);
    # until then a load may pick the dead copy, fail, and compute instead.
    time.sleep(max(0.0, killed + 11.0 - time.monotonic()))
    again, _ = await _generate(decode.address, _request("r-a2", prompt, a.address))
    assert again == computed
    assert _metric(a_port, "pdserve:kv_store_hit_blocks_total") == full
    assert _metric(a_port, "pdserve:prompt_tokens_computed_total") == len(prompt) - full * BS

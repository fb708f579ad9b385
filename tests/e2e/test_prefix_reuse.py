"""Prefix reuse across the fleet, end to end: redis-server, the scheduler, the gateway, two
prefill workers and a decode worker as real processes (``pdserve up``'s launcher), the real
model, the official ``openai`` client.

The decode worker never prefills here (``--local-prefill-max-tokens 0``), so every prompt is
routed to one of the two prefill workers, and only routing by the workers' KV events sends
a repeated prefix to the worker that holds it.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request

import openai
import pytest

from bench.prefix.probe import ask, format_rounds, run_rounds, system_prompt
from services.launcher import Stack, free_port
from services.up import launch, load_up_config
from tests.e2e.supervision import supervised
from tests.scrape import metric_in

ROUNDS = 4
PREFIXES = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    args = load_up_config(
        ["--prefill", "2", "--decode", "1", "--kv-cache-mib", "512",
         "--local-prefill-max-tokens", "0", "--routing", "cache-aware",
         "--http-port", str(free_port()), "--grpc-port", str(free_port()),
         "--heartbeat-ttl-s", "3"], {}
    )  # fmt: skip
    st = Stack(log_dir=tmp_path_factory.mktemp("prefix-stack"))
    try:
        endpoints = launch(args, st)
        yield st, endpoints
    finally:
        st.stop()


def shared_tokens(tokenizer, k: int) -> int:
    """Prompt tokens two questions to desk ``k`` share, in whole 16-token blocks."""
    a, b = (
        tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "system", "content": system_prompt(k)}, {"role": "user", "content": q}]
        ))
        for q in ("First question?", "Another one entirely!")
    )  # fmt: skip
    n = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return n // 16 * 16


def fleet_known(metrics_url: str, **by_role: int) -> bool:
    """Whether the scheduler at ``metrics_url`` has these many workers of each role (False
    while it is down)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return False
    return all(
        metric_in(text, "pdserve_scheduler_workers", f'role="{role}"', absent=-1) == n
        for role, n in by_role.items()
    )


def client_of(endpoints) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=endpoints["http"], api_key="unused", max_retries=0)


async def test_four_prefixes_hit_after_round_0_on_two_prefill_workers(
    stack, default_tokenizer
) -> None:
    """The issue's probe: four ~900-token system prompts, four at a time, a new question
    each round. From round 1 on every request finds its prefix cached (the prefill worker
    computed only the question)."""
    _, endpoints = stack
    client = client_of(endpoints)
    model = (await client.models.list()).data[0].id
    shared = [shared_tokens(default_tokenizer, k) for k in range(PREFIXES)]
    assert all(n >= 800 for n in shared), shared
    rounds, alone = await asyncio.wait_for(
        run_rounds(client, model, prefixes=PREFIXES, rounds=ROUNDS), 300
    )
    print(format_rounds(rounds, alone))
    assert all(a.cached_tokens < 100 for a in rounds[0]), "round 0 must start cold"
    for r in range(1, ROUNDS):
        for k, a in enumerate(rounds[r]):
            assert a.cached_tokens >= shared[k], (r, k, a, shared[k])
    assert alone.cached_tokens >= shared[0]


async def test_a_restarted_scheduler_routes_its_first_request_to_the_prefix(
    stack, default_tokenizer
) -> None:
    """Kill -9 the scheduler; the one the supervisor starts rebuilds the placement index
    (Redis, then the workers' snapshots): the first requests it routes hit their prefixes.
    Desks 1 and 2 sit on different prefill workers (warmed at once, the second goes to the
    idle worker); a scheduler without the index would send both to the same one.

    The requests wait until the new scheduler knows all three workers: as they register
    again (one heartbeat: workers restored from Redis are hints until then) and send their
    cache snapshots. Before that, a prompt whose worker is not back yet goes to the other
    one."""
    st, endpoints = stack
    client = client_of(endpoints)
    model = (await client.models.list()).data[0].id
    await asyncio.wait_for(
        asyncio.gather(*(ask(client, model, system_prompt(k), "Warm it, please?") for k in (1, 2))),
        120,
    )
    said: list[str] = []
    victim = st.named("scheduler")
    assert victim.popen is not None
    async with supervised(st, said):
        victim.popen.kill()
        victim.popen.wait(5)
        killed = time.monotonic()
        while not fleet_known(endpoints["scheduler-metrics"], prefill=2, decode=1):
            assert time.monotonic() - killed < 30, f"the workers are not back: {said}"
            await asyncio.sleep(0.1)
        while True:
            try:
                first = await ask(client, model, system_prompt(1), "First after the restart?")
                break
            except openai.APIError:
                assert time.monotonic() - killed < 30, f"not served again: {said}"
                await asyncio.sleep(0.2)
        second = await ask(client, model, system_prompt(2), "And the second one?")
    assert any(line.startswith("scheduler restarted") for line in said), said
    print(f"after the scheduler restart: {first}, then {second}")
    assert first.cached_tokens >= shared_tokens(default_tokenizer, 1), first
    assert second.cached_tokens >= shared_tokens(default_tokenizer, 2), second

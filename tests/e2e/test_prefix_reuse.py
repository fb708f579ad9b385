"""Prefix reuse across the fleet, end to end: redis-server, the scheduler, the gateway, two
prefill workers and a decode worker as real processes (``pdserve up``'s launcher), the real
model, the official ``openai`` client.

The decode worker never prefills here (``--local-prefill-max-tokens 0``), so every prompt is
routed to one of the two prefill workers, and only routing by the workers' KV events sends
a repeated prefix to the worker that holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import openai
import pytest

from services.launcher import Stack, free_port
from services.up import launch, load_up_config, supervise

ROUNDS = 4
PREFIXES = 4
TOPICS = ("tides", "volcanoes", "bees", "glaciers")


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


def system_prompt(k: int) -> str:
    """A ~900-token system prompt, distinct per ``k`` from its first words."""
    rules = " ".join(
        f"Rule {i} of the {TOPICS[k]} desk: cite a source for claim {i} and keep answer {i} "
        "under forty words."
        for i in range(33)
    )
    return f"You are desk {k}, an expert on {TOPICS[k]}. {rules}"


@dataclass(frozen=True)
class Answer:
    ttft_s: float
    cached_tokens: int
    prompt_tokens: int


async def ask(client: openai.AsyncOpenAI, model: str, k: int, question: str) -> Answer:
    started = time.monotonic()
    stream = await client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": system_prompt(k)},
            {"role": "user", "content": question},
        ],
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    ttft = None
    usage = None
    async for chunk in stream:
        if ttft is None and chunk.choices:
            ttft = time.monotonic() - started
        usage = chunk.usage or usage
    assert ttft is not None and usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    return Answer(ttft, cached, usage.prompt_tokens)


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
    rounds: list[list[Answer]] = []
    for r in range(ROUNDS):
        asks = (ask(client, model, k, f"Round {r}: what is fact number {r + k}?")
                for k in range(PREFIXES))  # fmt: skip
        rounds.append(list(await asyncio.wait_for(asyncio.gather(*asks), 180)))
    # One request alone, its prefix cached: the single-worker hit the rounds compare with.
    alone = await ask(client, model, 0, "One last question, asked alone?")
    for r, answers in enumerate(rounds):
        print(f"round {r}: TTFT " + " ".join(f"{a.ttft_s:.2f}" for a in answers)
              + " s; cached " + " ".join(str(a.cached_tokens) for a in answers))  # fmt: skip
    print(f"alone, cached: TTFT {alone.ttft_s:.2f} s, cached {alone.cached_tokens}")
    assert all(a.cached_tokens < 100 for a in rounds[0]), "round 0 must start cold"
    for r in range(1, ROUNDS):
        for k, a in enumerate(rounds[r]):
            assert a.cached_tokens >= shared[k], (r, k, a, shared[k])
    assert alone.cached_tokens >= shared[0]


@contextlib.asynccontextmanager
async def supervised(st: Stack, said: list[str]) -> AsyncIterator[None]:
    """``pdserve up``'s supervisor, ticking in the background as ``pdserve up`` does."""
    supervisor = supervise(st, said.append)

    async def tick() -> None:
        while supervisor.tick() is None:
            await asyncio.sleep(0.1)

    task = asyncio.create_task(tick())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_restarted_scheduler_routes_its_first_request_to_the_prefix(
    stack, default_tokenizer
) -> None:
    """Kill -9 the scheduler; the one the supervisor starts rebuilds the placement index
    (Redis, then the workers' snapshots): the first requests it routes hit their prefixes.
    Desks 1 and 2 sit on different prefill workers (warmed at once, the second goes to the
    idle worker); a scheduler without the index would send both to the same one."""
    st, endpoints = stack
    client = client_of(endpoints)
    model = (await client.models.list()).data[0].id
    await asyncio.wait_for(
        asyncio.gather(*(ask(client, model, k, "Warm the prefix, please?") for k in (1, 2))), 120
    )
    said: list[str] = []
    victim = st.named("scheduler")
    assert victim.popen is not None
    async with supervised(st, said):
        victim.popen.kill()
        victim.popen.wait(5)
        killed = time.monotonic()
        while True:
            try:
                first = await ask(client, model, 1, "The first question after the restart?")
                break
            except openai.APIError:
                assert time.monotonic() - killed < 30, f"not served again: {said}"
                await asyncio.sleep(0.2)
        second = await ask(client, model, 2, "And the second one?")
    assert any(line.startswith("scheduler restarted") for line in said), said
    print(f"after the scheduler restart: {first}, then {second}")
    assert first.cached_tokens >= shared_tokens(default_tokenizer, 1), first
    assert second.cached_tokens >= shared_tokens(default_tokenizer, 2), second

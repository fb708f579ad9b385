"""A migrated seeded stream continues exactly: the same tokens and the same logprobs, bit for
bit, as the same request undisturbed (issue 38). Real processes (``pdserve up``'s launcher:
redis-server, scheduler, gateway, a prefill worker and two decode workers on one transport),
the official ``openai`` client, the default model in batch-invariant mode.

Seeded streams run once undisturbed, then again while the decode worker running them all
is killed (kill -9) mid-stream (the other is frozen while they are placed, so every stream
starts on the victim): the gateway places each stream again with the tokens the client
already has, the prefill worker computes prompt + those tokens, the KV crosses the transport
to the other decode worker, and the stream goes on. The streams ask for what applications
send (issue 39, ``EXTRAS``): ``n`` = 2, penalties and ``logit_bias``, ``min_tokens``, a JSON
schema, a required and a named tool call; the new worker rebuilds each one's state (penalty
counts, the grammar matcher) from the tokens it resumes with. With the matcher's replay of
the resumed tokens taken out (2026-12-06) the JSON-schema stream restarts its object
mid-string and the test fails. One stream asks for ``top_logprobs``: its alternatives, too,
are the undisturbed run's.

The same requests through a colocated worker (``pdserve up --colocated``, the baseline) give
the disaggregated stack's streams bit for bit, seeded and greedy: the prefill worker samples
the first token with the request's penalties, grammar and random stream, the decode worker
the rest, as one engine does.

Without the mode (this test with ``--batch-invariant`` taken out, 2026-12-06) it fails:
the migrated streams' logprobs after the cut differ from the undisturbed run's in the last
bits (their text too, for about one seeded stream in a hundred: issue 38's runs).
"""

from __future__ import annotations

import asyncio
import signal
import time

import openai
import pytest

from services.launcher import Stack, free_port
from services.up import launch, load_up_config
from tests.scrape import metric

TOKENS = 96
STREAMS = 8
QUESTIONS = [f"Tell me a story about a lighthouse keeper, part {i}." for i in range(STREAMS)]
STORY_SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "story": {"type": "string"}},
    "required": ["title", "story"],
}
STORY_TOOL = {
    "type": "function",
    "function": {
        "name": "log_story",
        "parameters": {
            "type": "object",
            "properties": {"keeper": {"type": "string"}, "story": {"type": "string"}},
            "required": ["keeper", "story"],
        },
    },
}
# What each stream asks for beyond a seeded sample (issue 39): the migrated stream must
# continue exactly with all of it -- the penalties' counts, every choice of n, the grammar's
# state.
EXTRAS: list[dict[str, object]] = [
    {},
    {"n": 2},
    # the bias bans the two likeliest first tokens ('The', 'Once'): the prefill worker's
    # first token shows it was applied there too
    {"frequency_penalty": 0.8, "presence_penalty": 0.5,
     "logit_bias": {"13": -5, "504": -100, "6403": -100}},
    {"extra_body": {"repetition_penalty": 1.3, "min_tokens": 8}},
    {"response_format": {"type": "json_schema",
                         "json_schema": {"name": "story", "schema": STORY_SCHEMA}}},
    {"tools": [STORY_TOOL], "tool_choice": "required"},
    {"tools": [STORY_TOOL],
     "tool_choice": {"type": "function", "function": {"name": "log_story"}}},
    {"top_logprobs": 5},
]  # fmt: skip
SEEDED = {"temperature": 1.0, "top_p": 0.95}
GREEDY = {"temperature": 0.0}


def _start(tmp_path_factory, name: str, layout: list[str]):
    args = load_up_config(
        [*layout, "--kv-cache-mib", "96", "--http-port", str(free_port()), "--grpc-port", "0",
         "--heartbeat-ttl-s", "2", "--batch-invariant"],
        {},
    )  # fmt: skip
    st = Stack(log_dir=tmp_path_factory.mktemp(name))
    try:
        return st, launch(args, st)
    except BaseException:
        st.stop()
        raise


@pytest.fixture(scope="module", params=["shm", pytest.param("tcp", marks=pytest.mark.slow)])
def stack(request, tmp_path_factory):
    layout = ["--prefill", "1", "--decode", "2", "--transport", request.param,
              "--local-prefill-max-tokens", "0"]  # fmt: skip
    st, endpoints = _start(tmp_path_factory, f"exact-{request.param}", layout)
    try:
        yield st, endpoints
    finally:
        st.stop()


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    """The baseline: one colocated worker behind the same scheduler and gateway."""
    st, endpoints = _start(tmp_path_factory, "exact-colocated", ["--colocated"])
    try:
        yield endpoints
    finally:
        st.stop()


Choice = tuple[str, list[float], list[list[tuple[str, float]]]]  # a choice's streamed text
# (content and tool-call arguments), every token's logprob and its top logprobs (if asked)


async def _stream(
    client: openai.AsyncOpenAI,
    model: str,
    i: int,
    seen: list[int],
    sampling: dict[str, float] = SEEDED,
) -> list[Choice]:
    """Stream ``i``: each choice's text, logprobs and top logprobs; ``seen[i]`` counts the
    fewest tokens any of its choices has so far."""
    extras = dict(EXTRAS[i])
    body = {"ignore_eos": True, **extras.pop("extra_body", {})}  # type: ignore[dict-item]
    n = int(extras.get("n", 1))  # type: ignore[call-overload]
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTIONS[i]}],
        max_tokens=TOKENS,
        seed=1000 + i,
        logprobs=True,
        stream=True,
        extra_body=body,
        **sampling,  # type: ignore[arg-type]
        **extras,  # type: ignore[arg-type]
    )
    text: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    tops: list[list[list[tuple[str, float]]]] = [[] for _ in range(n)]
    async for chunk in stream:
        for choice in chunk.choices:
            k = choice.index
            text[k].append(choice.delta.content or "")
            for call in choice.delta.tool_calls or []:
                text[k].append((call.function.name or "") + (call.function.arguments or ""))
            for t in (choice.logprobs.content or []) if choice.logprobs else []:
                logprobs[k].append(t.logprob)
                tops[k].append([(a.token, a.logprob) for a in t.top_logprobs])
        seen[i] = min(len(lps) for lps in logprobs)
    return [("".join(t), lps, top) for t, lps, top in zip(text, logprobs, tops, strict=True)]


async def _connect(base_url: str) -> tuple[openai.AsyncOpenAI, str]:
    """A client of the gateway at ``base_url`` and the model it serves."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    return client, (await client.models.list()).data[0].id


async def _all(base_url: str, sampling: dict[str, float]) -> list[list[Choice]]:
    """Every stream at once, undisturbed."""
    client, model = await _connect(base_url)
    seen = [0] * STREAMS
    runs = (_stream(client, model, i, seen, sampling) for i in range(STREAMS))
    return await asyncio.wait_for(asyncio.gather(*runs), 180)


def _assert_equal(got: list[list[Choice]], want: list[list[Choice]]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for k, ((g_text, g_lps, g_top), (w_text, w_lps, w_top)) in enumerate(
            zip(g, w, strict=True)
        ):
            assert g_text == w_text, f"stream {i} choice {k}: text differs"
            assert g_lps == w_lps, f"stream {i} choice {k}: logprobs differ"
            assert g_top == w_top, f"stream {i} choice {k}: top logprobs differ"


def _running(endpoints: dict[str, str], worker: str) -> float:
    return metric(endpoints[f"metrics:{worker}"], "pdserve:num_requests_running", 'role="decode"')


async def _workers(endpoints: dict[str, str], count: int) -> None:
    """Wait until the scheduler has ``count`` decode workers registered."""
    deadline = time.monotonic() + 30
    url = endpoints["scheduler-metrics"]
    while metric(url, "pdserve_scheduler_workers", 'role="decode"') != count:
        assert time.monotonic() < deadline, f"the scheduler never had {count} decode workers"
        await asyncio.sleep(0.1)


async def test_a_killed_decode_workers_seeded_streams_continue_bit_for_bit(stack) -> None:
    st, endpoints = stack
    undisturbed = await _all(endpoints["http"], SEEDED)
    client, model = await _connect(endpoints["http"])
    # Every stream runs long enough for the kill to land mid-stream (a constrained one may
    # end early: its grammar complete).
    assert all(len(lps) >= 16 for choices in undisturbed for _, lps, _ in choices)
    assert len(undisturbed[1]) == 2 and undisturbed[1][0] != undisturbed[1][1]
    assert [len(t) for t in undisturbed[7][0][2]] == [5] * len(undisturbed[7][0][1])

    # Every stream starts on the victim: the other decode worker is frozen (so it expires
    # from the scheduler) while they are placed, and back before the kill.
    victim, other = sorted((p for p in st.procs if p.name.startswith("decode-")),
                           key=lambda p: p.name)  # fmt: skip
    assert victim.popen is not None and other.popen is not None
    other.popen.send_signal(signal.SIGSTOP)
    try:
        await _workers(endpoints, 1)
        seen = [0] * STREAMS
        streams = [asyncio.ensure_future(_stream(client, model, i, seen)) for i in range(STREAMS)]
        deadline = time.monotonic() + 120
        while min(seen) < 4:  # every choice has tokens: the kill lands mid-stream
            assert time.monotonic() < deadline, seen
            assert not any(s.done() for s in streams)
            await asyncio.sleep(0.02)
    finally:
        other.popen.send_signal(signal.SIGCONT)
    choices = sum(len(c) for c in undisturbed)
    assert _running(endpoints, victim.name) == choices  # all of them, whatever they ask
    await _workers(endpoints, 2)
    cut = list(seen)
    victim.popen.kill()
    moved = await asyncio.wait_for(asyncio.gather(*streams), 180)
    gateway = endpoints["http"].removesuffix("/v1") + "/metrics"
    assert metric(gateway, "pdserve:migrations_total", 'cause="decode_lost"') >= choices
    # No stream had ended before the kill.
    ends = [min(len(lps) for _, lps, _ in choices) for choices in undisturbed]
    assert all(c < e for c, e in zip(cut, ends, strict=True)), (cut, ends)
    _assert_equal(moved, undisturbed)


async def test_colocated_gives_the_disaggregated_streams(stack, colocated) -> None:
    """The same requests, seeded and greedy, through a colocated worker give the
    disaggregated stack's streams bit for bit: text, tool calls, every choice of n, logprobs
    and top logprobs (the prefill worker samples the first token, the decode worker the
    rest, each with the request's penalties, grammar and random stream)."""
    _, endpoints = stack

    async def both(base_url: str) -> list[list[list[Choice]]]:
        return list(await asyncio.gather(_all(base_url, SEEDED), _all(base_url, GREEDY)))

    disaggregated = await both(endpoints["http"])
    for got, want in zip(await both(colocated["http"]), disaggregated, strict=True):
        _assert_equal(got, want)
    seeded, greedy = disaggregated
    # the extras took effect (a constrained stream may be cut at max_tokens)
    for run in (seeded, greedy):
        assert run[4][0][0].replace(" ", "").startswith('{"title":"')
        assert run[6][0][0].replace(" ", "").startswith('log_story{"keeper":"')
    assert seeded[1][0] != seeded[1][1] and greedy[1][0] == greedy[1][1]

"""The four-prefixes probe of issue 14, as a command: ``python -m bench.prefix.probe``.

Four ~900-token system prompts, sent four at a time in rounds, each request with a new
question; prints each round's TTFTs and cached tokens, then one request alone whose prefix
is cached (the single hit the rounds compare with). It starts its own ``pdserve up
--prefill N --decode 1`` stack (``--local-prefill-max-tokens 0``: every prompt goes to a
prefill worker), unless ``--base-url`` names a running gateway. ``tests/e2e/
test_prefix_reuse.py`` runs the same rounds and asserts the hits.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import openai

TOPICS = ("tides", "volcanoes", "bees", "glaciers", "comets", "ferns", "owls", "dunes")


def system_prompt(k: int, nonce: str = "") -> str:
    """A ~900-token system prompt (SmolLM2's tokenizer), distinct per ``k`` from its first
    words; ``nonce`` keeps two runs from sharing a cached block."""
    rules = " ".join(
        f"Rule {i} of the {TOPICS[k % len(TOPICS)]} desk: cite a source for claim {i} and keep "
        f"answer {i} under forty words."
        for i in range(33)
    )
    return f"{nonce}You are desk {k}, an expert on {TOPICS[k % len(TOPICS)]}. {rules}"


@dataclass(frozen=True)
class Answer:
    ttft_s: float
    cached_tokens: int
    prompt_tokens: int


async def ask(
    client: openai.AsyncOpenAI, model: str, system: str, question: str, timeout_s: float = 120.0
) -> Answer:
    """One streamed chat request (4 tokens, greedy): its TTFT and usage."""
    started = time.monotonic()
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        timeout=timeout_s,
    )
    ttft = None
    usage = None
    async for chunk in stream:
        if ttft is None and chunk.choices:
            ttft = time.monotonic() - started
        usage = chunk.usage or usage
    if ttft is None or usage is None:
        raise RuntimeError("the stream ended without a token or usage")
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    return Answer(ttft, cached, usage.prompt_tokens)


async def run_rounds(
    client: openai.AsyncOpenAI, model: str, *, prefixes: int, rounds: int, nonce: str = ""
) -> tuple[list[list[Answer]], Answer]:
    """``rounds`` rounds of ``prefixes`` concurrent requests, then one alone (prefix 0)."""
    out: list[list[Answer]] = []
    for r in range(rounds):
        asks = (ask(client, model, system_prompt(k, nonce), f"Round {r}: what is fact {r + k}?")
                for k in range(prefixes))  # fmt: skip
        out.append(list(await asyncio.gather(*asks)))
    alone = await ask(client, model, system_prompt(0, nonce), "One last question, asked alone?")
    return out, alone


def format_rounds(rounds: Sequence[Sequence[Answer]], alone: Answer) -> str:
    lines = [
        f"round {r}: TTFT " + " ".join(f"{a.ttft_s:.2f}" for a in answers) + " s; cached "
        + " ".join(str(a.cached_tokens) for a in answers) + f" of {answers[0].prompt_tokens}"
        for r, answers in enumerate(rounds)
    ]  # fmt: skip
    lines.append(f"alone, prefix cached: TTFT {alone.ttft_s:.2f} s, cached {alone.cached_tokens}")
    return "\n".join(lines)


async def _probe(base_url: str, prefixes: int, rounds: int) -> str:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    model = (await client.models.list()).data[0].id
    nonce = f"Run {time.time_ns() % 1_000_000_007}. "
    got, alone = await run_rounds(client, model, prefixes=prefixes, rounds=rounds, nonce=nonce)
    return format_rounds(got, alone)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.prefix.probe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--prefill", type=int, default=2, help="prefill workers (default 2)")
    parser.add_argument("--routing", default="cache-aware", help="scheduler routing policy")
    parser.add_argument("--prefixes", type=int, default=4, help="system prompts (default 4)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds (default 4)")
    parser.add_argument("--base-url", help="a running gateway's /v1 URL (no stack started)")
    args = parser.parse_args(argv)
    if args.base_url:
        print(asyncio.run(_probe(args.base_url, args.prefixes, args.rounds)))
        return 0
    from services.launcher import Stack, default_log_dir, free_port
    from services.up import launch, load_up_config

    up = load_up_config(
        ["--prefill", str(args.prefill), "--decode", "1", "--routing", args.routing,
         "--local-prefill-max-tokens", "0", "--http-port", str(free_port()),
         "--grpc-port", str(free_port())], {}
    )  # fmt: skip
    stack = Stack(log_dir=default_log_dir())
    try:
        endpoints = launch(up, stack)
        print(f"pdserve up --prefill {args.prefill} --decode 1 --routing {args.routing} "
              "--local-prefill-max-tokens 0", flush=True)  # fmt: skip
        print(asyncio.run(_probe(endpoints["http"], args.prefixes, args.rounds)))
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Do constrained streams slow the unconstrained streams beside them?

Against a running gateway, ``--plain`` unconstrained chat streams run closed-loop (each
client sends its next request when the last ends) beside ``--beside`` more streams, in two
kinds of phase that keep the batch the same size:

- ``plain``: the ``--beside`` streams are unconstrained too;
- ``mixed``: the ``--beside`` streams ask for a JSON schema (``response_format``), so every
  decode step masks their rows with the grammar.

Phases alternate ``--repeats`` times. Only the ``--plain`` streams' inter-token gaps are
measured (time between SSE chunks that carry tokens). The grammar costs its neighbours
nothing that matters when the mixed phases' median ITL P50 and P99 move from the plain
phases' by no more than the plain phases' spread (max - min over the repeats)::

    python -m bench.constrained_itl --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from bench._common import percentile

# An array no request can finish (minItems): a constrained request is as long as a plain
# one, so both kinds of phase start requests (prefills) equally often.
SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 500,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "ok": {"type": "boolean"},
            "colour": {"enum": ["red", "green", "blue"]},
        },
        "required": ["name", "ok", "colour"],
        "additionalProperties": False,
    },
}


@dataclass(frozen=True)
class Phase:
    kind: str  # plain or mixed
    gaps_ms: list[float]

    @property
    def p50(self) -> float:
        return percentile(self.gaps_ms, 50)

    @property
    def p99(self) -> float:
        return percentile(self.gaps_ms, 99)


async def _stream(
    session: Any, url: str, model: str, tokens: int, constrained: bool
) -> list[float]:
    """One request's inter-token gaps (ms)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a story about the sea."}],
        "max_tokens": tokens,
        "temperature": 1.0,
        "stream": True,
        "ignore_eos": True,
    }
    if constrained:
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
        body["response_format"] = fmt
    gaps: list[float] = []
    last: float | None = None
    async with session.post(url, json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if not choices or not choices[0].get("delta", {}).get("content"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append((now - last) * 1000)
            last = now
    return gaps


async def _phase(
    base_url: str, model: str, kind: str, plain: int, beside: int, seconds: float, tokens: int
) -> Phase:
    import aiohttp

    url = base_url.rstrip("/") + "/chat/completions"
    deadline = time.monotonic() + seconds
    measured: list[float] = []

    async def client(measure: bool, constrained: bool) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
            while time.monotonic() < deadline:
                gaps = await _stream(s, url, model, tokens, constrained)
                if measure:
                    measured.extend(gaps)

    await asyncio.gather(
        *(client(True, False) for _ in range(plain)),
        *(client(False, kind == "mixed") for _ in range(beside)),
    )
    return Phase(kind, measured)


async def run(args: argparse.Namespace) -> list[Phase]:
    import openai

    client = openai.AsyncOpenAI(base_url=args.base_url, api_key="unused", max_retries=0)
    model = (await client.models.list()).data[0].id
    await client.close()
    phases = []
    for _ in range(args.repeats):
        for kind in ("plain", "mixed"):
            phases.append(
                await _phase(
                    args.base_url, model, kind, args.plain, args.beside, args.seconds, args.tokens
                )
            )
            p = phases[-1]
            print(f"{kind:6} ITL P50 {p.p50:6.1f} ms  P99 {p.p99:6.1f} ms  ({len(p.gaps_ms)} gaps)")
    return phases


def report(phases: list[Phase]) -> tuple[str, bool]:
    """The summary lines and whether the mixed phases stay within the plain phases' spread."""
    lines = []
    ok = True
    for stat in ("p50", "p99"):
        plain = [getattr(p, stat) for p in phases if p.kind == "plain"]
        mixed = [getattr(p, stat) for p in phases if p.kind == "mixed"]
        spread = max(plain) - min(plain)
        moved = statistics.median(mixed) - statistics.median(plain)
        inside = abs(moved) <= spread
        ok = ok and inside
        lines.append(
            f"{stat.upper()}: plain {statistics.median(plain):.1f} ms "
            f"(runs {', '.join(f'{v:.1f}' for v in plain)}; spread {spread:.1f}), "
            f"mixed {statistics.median(mixed):.1f} ms (runs {', '.join(f'{m:.1f}' for m in mixed)})"
            f": moved {moved:+.1f} ms, {'within' if inside else 'BEYOND'} the spread"
        )
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.constrained_itl", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="default: %(default)s")
    p.add_argument("--plain", type=int, default=4, help="measured unconstrained streams (4)")
    p.add_argument("--beside", type=int, default=4, help="streams beside them (4)")
    p.add_argument("--seconds", type=float, default=20.0, help="each phase (20)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per request (64)")
    p.add_argument("--repeats", type=int, default=3, help="plain/mixed pairs (3)")
    args = p.parse_args(argv)
    phases = asyncio.run(run(args))
    text, ok = report(phases)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

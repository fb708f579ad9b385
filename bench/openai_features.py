"""What applications and agents send, through the unmodified OpenAI SDK: a checklist run.

Against a running gateway (``pdserve up``, colocated or disaggregated), with the official
``openai`` client and nothing else:

- **structured outputs**: ``SCHEMAS`` JSON Schemas of growing nesting, each asked with
  ``n`` choices, whole and streamed; every choice must parse and validate;
- **tools**: a weather conversation with ``tool_choice`` auto, required and a named function:
  the calls come back as ``tool_calls`` (streamed deltas assembled too), their arguments
  validate against the tool's schema, the tool's result goes back, and the model answers;
- **penalties and logit_bias**, as vLLM documents them: a frequency penalty repeats a token
  less, ``logit_bias`` -100 bans a token and +100 forces it;
- **top_logprobs**: five alternatives a token, most likely first, the sampled token among
  them with the logprob it was given;
- with ``--compare-url``, greedy output of both gateways (say colocated and disaggregated)
  must be the same for all of the above.

Prints one line per check and exits 1 if any failed::

    python -m bench.openai_features --base-url http://127.0.0.1:8000/v1 [--compare-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

SCHEMAS = 20
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def schema(level: int) -> dict[str, Any]:
    """Schema ``level`` (1, 2, ...): each level nests the previous one a step deeper and
    adds a kind of field (strings bounded so a small model finishes them)."""
    kinds: list[dict[str, Any]] = [
        {"type": "string", "maxLength": 16},
        {"type": "boolean"},
        {"type": "string", "enum": ["red", "green", "blue"]},
        {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        {"type": "integer"},
    ]
    props: dict[str, Any] = {f"f{i}": kinds[i % len(kinds)] for i in range(1 + level % 4)}
    if level > 1:
        props["child"] = schema(level - 2) if level > 2 else {"type": "null"}
    return {
        "type": "object",
        "properties": props,
        "required": sorted(props),
        "additionalProperties": False,
    }


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


async def _json_schemas(client: Any, model: str, n: int, count: int) -> Check:
    import jsonschema

    valid = total = 0
    failures: list[str] = []
    for level in range(1, count + 1):
        s = schema(level)
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{level}", "schema": s}}
        messages = [{"role": "user", "content": f"Fill in example {level}."}]
        # A budget no schema here needs (the deepest take ~400 tokens): a choice cut by
        # max_tokens would be a truncated JSON, not a grammar's failure.
        args = {"model": model, "messages": messages, "n": n, "max_tokens": 1024, "seed": level}
        whole = await client.chat.completions.create(response_format=fmt, **args)
        texts = [c.message.content or "" for c in whole.choices]
        stream = await client.chat.completions.create(response_format=fmt, stream=True, **args)
        streamed = [""] * n
        async for chunk in stream:
            for c in chunk.choices:
                streamed[c.index] += c.delta.content or ""
        for how, outputs in (("whole", texts), ("streamed", streamed)):
            for k, text in enumerate(outputs):
                total += 1
                try:
                    jsonschema.validate(json.loads(text), s)
                    valid += 1
                except (ValueError, jsonschema.ValidationError) as exc:
                    failures.append(f"schema {level} {how} choice {k}: {str(exc)[:80]}")
    detail = f"{valid}/{total} outputs valid ({count} schemas x n={n} x whole+streamed)"
    return Check("json_schema", valid == total, detail + "".join(f"; {f}" for f in failures[:3]))


async def _tool_turn(client: Any, model: str, choice: Any, stream: bool) -> tuple[Any, list]:
    """One weather turn; returns the assistant message and its calls as (id, name, args)."""
    import jsonschema

    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "What is the weather like in Paris today?"}
    ]
    args = {"model": model, "messages": messages, "tools": [WEATHER_TOOL], "max_tokens": 128}
    args.update(tool_choice=choice, temperature=0)
    if not stream:
        msg = (await client.chat.completions.create(**args)).choices[0].message
        calls = [(c.id, c.function.name, c.function.arguments) for c in msg.tool_calls or []]
    else:
        parts: dict[int, list[str]] = {}
        content = ""
        async for chunk in await client.chat.completions.create(stream=True, **args):
            for c in chunk.choices:
                content += c.delta.content or ""
                for d in c.delta.tool_calls or []:
                    entry = parts.setdefault(d.index, ["", "", ""])
                    entry[0] = d.id or entry[0]
                    entry[1] = (d.function.name if d.function else None) or entry[1]
                    entry[2] += (d.function.arguments if d.function else None) or ""
        calls = [tuple(parts[i]) for i in sorted(parts)]
        msg = {"role": "assistant", "content": content or None}
    for _, name, arguments in calls:
        assert name == "get_weather", name
        jsonschema.validate(json.loads(arguments), WEATHER_TOOL["function"]["parameters"])
    return msg, calls


async def _tools(client: Any, model: str) -> Check:
    named = {"type": "function", "function": {"name": "get_weather"}}
    results = []
    ok = True
    for label, choice in (("auto", "auto"), ("required", "required"), ("named", named)):
        for stream in (False, True):
            try:
                _, calls = await _tool_turn(client, model, choice, stream)
            except Exception as exc:  # a failed check, reported
                ok = False
                results.append(f"{label}{'/stream' if stream else ''}: {exc!s:.80}")
                continue
            if label != "auto" and not calls:
                ok = False
            results.append(f"{label}{'/stream' if stream else ''}: {len(calls)} call(s)")
    # The conversation goes on: the call, its result, then the answer.
    _, calls = await _tool_turn(client, model, "required", False)
    call_id, name, arguments = calls[0]
    messages = [
        {"role": "user", "content": "What is the weather like in Paris today?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    final = await client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER_TOOL], max_tokens=64, temperature=0
    )
    answer = final.choices[0].message.content or ""
    ok = ok and bool(answer.strip()) and "<tool" not in answer
    results.append(f"answer after the tool: {answer.strip()[:60]!r}")
    return Check("tools", ok, "; ".join(results))


async def _penalties(client: Any, model: str) -> Check:
    from collections import Counter

    prompt = "List the word 'apple' many times: apple apple apple"
    base = {"model": model, "prompt": prompt, "max_tokens": 48, "temperature": 0}
    plain = (await client.completions.create(**base, logprobs=0)).choices[0]
    tokens = plain.logprobs.tokens
    top, count = Counter(tokens).most_common(1)[0]
    pen = await client.completions.create(**base, frequency_penalty=2.0, logprobs=0)
    pen_count = Counter(pen.choices[0].logprobs.tokens)[top]
    first = (await client.completions.create(**{**base, "max_tokens": 1})).choices[0]
    first_id = _token_id(first.text)
    banned = await client.completions.create(
        **{**base, "max_tokens": 1}, logit_bias={str(first_id): -100}
    )
    forced = await client.completions.create(
        **{**base, "max_tokens": 4}, logit_bias={str(first_id): 100}
    )
    ok = pen_count < count and banned.choices[0].text != first.text
    ok = ok and forced.choices[0].text == first.text * 4
    detail = (
        f"{top!r} {count}x plain, {pen_count}x with frequency_penalty=2; "
        f"bias -100 on {first.text!r}: got {banned.choices[0].text!r}; "
        f"+100: {forced.choices[0].text!r}"
    )
    return Check("penalties+logit_bias", ok, detail)


def _token_id(text: str) -> int:
    """The id of ``text``'s last token under the default model's tokenizer (the one
    ``pdserve up`` serves unless told otherwise)."""
    from bench.serve.workload import default_tokenizer

    return default_tokenizer().encode(text, add_special_tokens=False)[-1]


async def _top_logprobs(client: Any, model: str) -> Check:
    resp = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name a fruit."}],
        max_tokens=8,
        temperature=1.0,
        seed=5,
        logprobs=True,
        top_logprobs=5,
    )
    bad = []
    for k, t in enumerate(resp.choices[0].logprobs.content):
        alts = t.top_logprobs
        lps = [a.logprob for a in alts]
        if len(alts) != 5 or lps != sorted(lps, reverse=True):
            bad.append(f"token {k}: {len(alts)} alternatives")
        mine = [a.logprob for a in alts if a.token == t.token]
        if mine and abs(mine[0] - t.logprob) > 1e-4:
            bad.append(f"token {k}: {t.logprob} vs {mine[0]} in the list")
    tokens = len(resp.choices[0].logprobs.content)
    return Check("top_logprobs=5", not bad, f"{tokens} tokens; " + ("; ".join(bad) or "all ok"))


CHECKS: dict[str, Callable[..., Awaitable[Check]]] = {
    "json_schema": _json_schemas,
    "tools": _tools,
    "penalties": _penalties,
    "top_logprobs": _top_logprobs,
}


async def run(base_url: str, n: int, schemas: int, api_key: str) -> list[Check]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    checks = []
    for name, fn in CHECKS.items():
        started = time.monotonic()
        kwargs = {"n": n, "count": schemas} if name == "json_schema" else {}
        try:
            check = await fn(client, model, **kwargs)
        except Exception as exc:  # a failed check, reported
            check = Check(name, False, f"{type(exc).__name__}: {exc!s:.200}")
        check.detail += f" ({time.monotonic() - started:.1f} s)"
        checks.append(check)
    await client.close()
    return checks


async def greedy_outputs(base_url: str, api_key: str) -> list[str]:
    """What ``--compare-url`` compares: greedy outputs of every feature above."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    out = []
    for level in (1, 4, 9):
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema(level)}}
        r = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Fill it in."}],
            response_format=fmt,
            max_tokens=200,
            temperature=0,
        )
        out.append(r.choices[0].message.content or "")
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        _, calls = await _tool_turn(client, model, choice, False)
        out.append(json.dumps([c[1:] for c in calls]))
    r = await client.completions.create(
        model=model,
        prompt="apple apple apple",
        max_tokens=24,
        temperature=0,
        frequency_penalty=1.0,
        presence_penalty=0.5,
        logit_bias={"28": 5},
        logprobs=5,
    )
    out.append(r.choices[0].text + json.dumps(r.choices[0].logprobs.top_logprobs))
    await client.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.openai_features", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="default: %(default)s")
    p.add_argument("--compare-url", help="a second gateway whose greedy output must be the same")
    p.add_argument("--n", type=int, default=4, help="choices per JSON schema request (4)")
    p.add_argument("--schemas", type=int, default=SCHEMAS, help="JSON schemas (%(default)s)")
    p.add_argument("--api-key", default="unused")
    args = p.parse_args(argv)
    checks = asyncio.run(run(args.base_url, args.n, args.schemas, args.api_key))
    if args.compare_url:
        a = asyncio.run(greedy_outputs(args.base_url, args.api_key))
        b = asyncio.run(greedy_outputs(args.compare_url, args.api_key))
        same = sum(x == y for x, y in zip(a, b, strict=True))
        checks.append(Check("same as --compare-url", same == len(a), f"{same}/{len(a)} equal"))
    for c in checks:
        print(f"{'PASS' if c.ok else 'FAIL'}  {c.name:22} {c.detail}")
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

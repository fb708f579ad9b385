"""Structured outputs over the OpenAI HTTP edge, driven by the official client: JSON schema
outputs, streamed and whole, parse and validate against their schema and equal the engine's
own; vLLM's extras work; a schema that does not compile is a 400 naming the parameter."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

from engine.sampling_params import SamplingParams
from engine.structured import StructuredKind, StructuredOutput
from tests.engine.test_structured import SCHEMAS
from tests.services.gateway.harness import MODEL, running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gw(make_engine):
    async with running_gateway(make_engine, grpc=False) as g:
        yield g


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(gw):
    c = AsyncOpenAI(base_url=gw.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    await c.close()


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


@pytest.mark.parametrize("index", [1, 9, 14], ids=["flat", "nested", "array-of-objects"])
async def test_json_schema_streamed_and_whole(gw, client, default_tokenizer, index) -> None:
    what, schema = SCHEMAS[index]
    messages = [{"role": "user", "content": f"Give me {what} as JSON."}]
    ask = {"model": MODEL, "messages": messages, "max_tokens": 96, "temperature": 0,
           "response_format": _format(schema)}  # fmt: skip
    whole = await client.chat.completions.create(**ask)
    stream = await client.chat.completions.create(**ask, stream=True)
    chunks = [c async for c in stream]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    text = whole.choices[0].message.content
    assert streamed == text and whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)
    tok = default_tokenizer
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    so = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(schema))
    _, ref = await gw.reference(ids, SamplingParams(max_tokens=96, temperature=0, structured=so))
    assert text == ref


async def test_vllm_extras_and_a_bad_schema(client) -> None:
    resp = await client.completions.create(
        model=MODEL, prompt="My phone number is", max_tokens=16, temperature=0,
        extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"},
    )  # fmt: skip
    text = resp.choices[0].text
    assert len(text) == 8 and text[3] == "-" and resp.choices[0].finish_reason == "stop"
    resp = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=8,
        temperature=0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    assert resp.choices[0].message.content in ("yes", "no")
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}],
            response_format=_format({"type": "object", "properties": {"a": {"type": "strin"}}}),
        )  # fmt: skip
    err = info.value.body
    assert err["param"] == "response_format.json_schema.schema" and "strin" in err["message"]

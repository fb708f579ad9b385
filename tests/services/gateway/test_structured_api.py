"""Structured-output parameters at the HTTP edge (``services.gateway.structured_api``): each
spelling OpenAI and vLLM use becomes one ``StructuredOutput``; a malformed, uncompilable or
doubled constraint is a 400 naming the parameter."""

from __future__ import annotations

import json

import pytest

from engine.errors import InvalidRequestError
from engine.structured import StructuredKind as K
from engine.structured import StructuredOutput
from pdserve.v1 import common_pb2
from services.gateway import grpc_convert
from services.gateway.openai_api import ApiError, parse_chat, parse_completion

M = "smol"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _chat(**fields) -> dict:
    return {"model": M, "messages": [{"role": "user", "content": "Hi"}], **fields}


def _cmpl(**fields) -> dict:
    return {"model": M, "prompt": "Hello", **fields}


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, (K.JSON_OBJECT, "")),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
                }
            },
            (K.JSON_SCHEMA, json.dumps(SCHEMA)),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, (K.JSON_SCHEMA, json.dumps(SCHEMA))),
        ({"structured_outputs": {"regex": "[0-9]+"}}, (K.REGEX, "[0-9]+")),
        ({"structured_outputs": {"choice": ["x", "y"]}}, (K.CHOICE, '["x", "y"]')),
        ({"structured_outputs": {"grammar": 'start: "hi"'}}, (K.GRAMMAR, 'start: "hi"')),
        ({"structured_outputs": {"json_object": True}}, (K.JSON_OBJECT, "")),
        ({"guided_json": json.dumps(SCHEMA)}, (K.JSON_SCHEMA, json.dumps(SCHEMA))),
        ({"guided_regex": "a|b"}, (K.REGEX, "a|b")),
        ({"guided_choice": ["x"]}, (K.CHOICE, '["x"]')),
        ({"guided_grammar": 'root ::= "hi"'}, (K.GRAMMAR, 'root ::= "hi"')),
    ],
)
def test_every_spelling_becomes_one_constraint(fields: dict, want) -> None:
    expected = None if want is None else StructuredOutput(*want)
    assert parse_chat(_chat(**fields), {M}).params.structured == expected
    assert parse_completion(_cmpl(**fields), {M}).params.structured == expected
    assert parse_chat(_chat(), {M}).params.structured is None


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"response_format": "json"}, "response_format", "expected an object"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "not supported"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
         "response_format.json_schema.name", "non-empty string"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
         "response_format.json_schema.schema", "JSON Schema"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "a", "schema": {"type": "strin"}}}},
         "response_format.json_schema.schema", "strin"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "regex"),
        ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar", "foo"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag",
         "not supported"),
        ({"guided_json": "{not json"}, "guided_json", "not JSON"),
        ({"guided_regex": 5}, "guided_regex", "expected a string"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
         "'response_format' and 'guided_regex'"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice",
         "both constrain"),
    ],
)  # fmt: skip
def test_a_bad_constraint_is_a_400_naming_its_parameter(fields: dict, param: str, needle) -> None:
    for parse, body in ((parse_chat, _chat(**fields)), (parse_completion, _cmpl(**fields))):
        with pytest.raises(ApiError) as info:
            parse(body, {M})
        err = info.value
        assert (err.status, err.param) == (400, param), err
        assert needle in err.message, err


def test_the_grpc_edge_checks_the_proto_field() -> None:
    ok = common_pb2.SamplingParams(
        structured=common_pb2.StructuredOutput(kind=common_pb2.STRUCTURED_KIND_REGEX, spec="a+")
    )
    assert grpc_convert.sampling_from_proto(ok).structured == StructuredOutput(K.REGEX, "a+")
    for spec, needle in [
        (common_pb2.StructuredOutput(kind=common_pb2.STRUCTURED_KIND_REGEX, spec="[a-"), "regex"),
        (common_pb2.StructuredOutput(spec="a"), "kind"),
    ]:
        with pytest.raises(InvalidRequestError, match=needle):
            grpc_convert.sampling_from_proto(common_pb2.SamplingParams(structured=spec))

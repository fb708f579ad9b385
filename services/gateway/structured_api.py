"""A request body's structured-output parameters, OpenAI's and vLLM's, as one
``StructuredOutput`` (pure; the schema, regex or grammar compiled and checked here so a bad
one is a 400 naming its parameter, before any worker sees it).

Accepted, at most one constraint per request (two are a 400 naming both):

- OpenAI's ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``
  (the schema is enforced whatever ``strict`` says);
- vLLM's ``structured_outputs`` object with one of ``json`` (a schema, object or text),
  ``regex``, ``choice`` (strings), ``grammar`` (Lark or GBNF), ``json_object`` (true);
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.
"""

from __future__ import annotations

import json
from typing import Any

from engine.errors import InvalidRequestError
from engine.grammar_text import check
from engine.structured import StructuredKind, StructuredOutput


class ParamError(ValueError):
    """A parameter the request got wrong; ``openai_api`` answers it as a 400 naming it."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def bad_request(message: str, param: str) -> ParamError:
    return ParamError(message, param)


def wrong_type(name: str, expected: str, value: object) -> ParamError:
    got = "null" if value is None else type(value).__name__
    return ParamError(
        f"Invalid type for '{name}': expected {expected}, but got {got} instead.",
        name,
        "invalid_type",
    )


# vLLM's names for each kind, in structured_outputs and as guided_* fields.
_VLLM = {
    "json": StructuredKind.JSON_SCHEMA,
    "regex": StructuredKind.REGEX,
    "choice": StructuredKind.CHOICE,
    "grammar": StructuredKind.GRAMMAR,
}


def structured(body: dict[str, Any]) -> StructuredOutput | None:
    """The one constraint ``body`` asks for, compiled and checked; ``ParamError`` naming the
    parameter when it is malformed, does not compile, or is not alone."""
    asked = _response_format(body.get("response_format"))
    asked += _structured_outputs(body.get("structured_outputs"))
    for key, kind in _VLLM.items():
        name = f"guided_{key}"
        if body.get(name) is not None:
            asked.append((name, _vllm(name, kind, body[name])))
    if len(asked) > 1:
        first, second = asked[0][0], asked[1][0]
        raise bad_request(
            f"'{first}' and '{second}' both constrain the output: give one of them.", second
        )
    if not asked:
        return None
    param, out = asked[0]
    try:
        check(out)
    except InvalidRequestError as exc:
        raise bad_request(f"'{param}': {exc}", param) from None
    return out


def _response_format(fmt: object) -> list[tuple[str, StructuredOutput]]:
    """OpenAI's ``response_format``: no constraint, or one named by its parameter."""
    if fmt is None:
        return []
    if not isinstance(fmt, dict):
        raise wrong_type("response_format", "an object", fmt)
    kind = fmt.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", StructuredOutput(StructuredKind.JSON_OBJECT))]
    if kind != "json_schema":
        raise bad_request(
            f"response_format type {kind!r} is not supported: one of 'text', 'json_object', "
            "'json_schema'.",
            "response_format.type",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise wrong_type("response_format.json_schema", "an object", spec)
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise wrong_type("response_format.json_schema.name", "a non-empty string", name)
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise wrong_type("response_format.json_schema.strict", "a boolean", strict)
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise wrong_type("response_format.json_schema.schema", "a JSON Schema object", schema)
    param = "response_format.json_schema.schema"
    return [(param, _make(param, StructuredKind.JSON_SCHEMA, schema))]


def _structured_outputs(value: object) -> list[tuple[str, StructuredOutput]]:
    if value is None:
        return []
    if not isinstance(value, dict):
        raise wrong_type("structured_outputs", "an object", value)
    out = []
    for key, item in value.items():
        name = f"structured_outputs.{key}"
        if item is None or item is False:
            continue
        if key == "json_object":
            if item is not True:
                raise wrong_type(name, "true", item)
            out.append((name, StructuredOutput(StructuredKind.JSON_OBJECT)))
        elif key in _VLLM:
            out.append((name, _vllm(name, _VLLM[key], item)))
        else:
            raise bad_request(
                f"'{name}' is not supported: one of json, regex, choice, grammar, json_object.",
                name,
            )
    return out


def _vllm(name: str, kind: StructuredKind, value: object) -> StructuredOutput:
    """vLLM's value for ``kind``: a schema as an object or JSON text, a regex or grammar as
    text, choices as an array of strings."""
    if kind is StructuredKind.JSON_SCHEMA:
        if not isinstance(value, dict | str):
            raise wrong_type(name, "a JSON Schema (an object or JSON text)", value)
        return _make(name, kind, value)
    if kind is StructuredKind.CHOICE:
        if not isinstance(value, list):
            raise wrong_type(name, "an array of strings", value)
        return _make(name, kind, value)
    if not isinstance(value, str):
        raise wrong_type(name, "a string", value)
    return _make(name, kind, value)


def _make(name: str, kind: StructuredKind, value: object) -> StructuredOutput:
    spec = value if isinstance(value, str) else json.dumps(value)
    try:
        return StructuredOutput(kind, spec)
    except InvalidRequestError as exc:
        raise bad_request(f"'{name}': {exc}", name) from None

"""A ``StructuredOutput`` as llguidance grammar text, checked: what every holder of a
request (the gateway, each worker) can compute without a tokenizer or torch.

``check`` is the one place a bad schema, regex or grammar is refused: an
``InvalidRequestError`` naming the problem. The gateway calls it while parsing so an HTTP
client gets a 400 naming its parameter; the engine calls it again (``engine.grammar``) when
it compiles the text against its tokenizer.
"""

from __future__ import annotations

import functools
import json

import llguidance

from engine.errors import InvalidRequestError
from engine.structured import StructuredKind, StructuredOutput

MAX_CACHED = 128  # grammar texts kept per process

# JSON as people and small models write it ({"a": 1, "b": [2, 3]}), whitespace fixed: a
# grammar that lets whitespace run on lets a weak model spend its whole budget on it.
_JSON_OPTIONS: llguidance.JsonCompileOptions = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}


@functools.lru_cache(maxsize=MAX_CACHED)
def check(structured: StructuredOutput) -> str:
    """The llguidance grammar for ``structured``; ``InvalidRequestError`` naming the problem
    when the schema, regex or grammar does not compile."""
    kind, spec = structured.kind, structured.spec
    try:
        if kind is StructuredKind.JSON_OBJECT:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=_JSON_OPTIONS
            )
        elif kind is StructuredKind.JSON_SCHEMA:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.loads(spec), defaults=_JSON_OPTIONS
            )
        elif kind is StructuredKind.REGEX:
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        elif kind is StructuredKind.CHOICE:
            grammar = llguidance.grammar_from("choice", spec)
        else:
            grammar = llguidance.grammar_from("grammar", spec)  # Lark, or llama.cpp's GBNF
    except ValueError as exc:
        raise InvalidRequestError(f"structured output {kind.value}: {exc}") from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise InvalidRequestError(f"structured output {kind.value}: {messages[0].strip()}")
    return grammar

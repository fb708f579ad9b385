"""What a request's output must look like: a structured-output constraint, as asked.

``StructuredOutput`` is the request's wish, validated for shape only (which kind, a string
spec, a bounded size). Compiling and checking it is ``engine.grammar_text``'s job (the
gateway's parse step calls it), masking the logits with it ``engine.grammar``'s; this
module has no dependency on a grammar library so the protos can carry the wish without
loading one.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from engine.errors import InvalidRequestError

MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar larger than this is refused


class StructuredKind(enum.StrEnum):
    JSON_OBJECT = "json_object"  # any JSON object (spec empty)
    JSON_SCHEMA = "json_schema"  # spec: a JSON Schema, as JSON text
    REGEX = "regex"  # spec: a regular expression the whole output matches
    CHOICE = "choice"  # spec: a JSON array of strings; the output is exactly one of them
    GRAMMAR = "grammar"  # spec: a grammar (Lark / EBNF) the whole output matches


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint on a request's whole output. ``spec`` as ``StructuredKind`` says."""

    kind: StructuredKind
    spec: str = ""

    def __post_init__(self) -> None:
        try:
            kind = StructuredKind(self.kind)
        except ValueError:
            kinds = ", ".join(k.value for k in StructuredKind)
            raise InvalidRequestError(
                f"structured output kind {self.kind!r} is invalid: one of {kinds}"
            ) from None
        object.__setattr__(self, "kind", kind)
        if not isinstance(self.spec, str):
            raise InvalidRequestError(f"structured output {kind.value}: the spec must be text")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequestError(
                f"structured output {kind.value}: the spec has {len(self.spec)} characters, "
                f"at most {MAX_SPEC_CHARS}"
            )
        if kind is not StructuredKind.JSON_OBJECT and not self.spec:
            raise InvalidRequestError(f"structured output {kind.value}: the spec is empty")
        if kind in (StructuredKind.JSON_SCHEMA, StructuredKind.CHOICE):
            try:
                value = json.loads(self.spec)
            except ValueError as exc:
                raise InvalidRequestError(
                    f"structured output {kind.value}: the spec is not JSON ({exc})"
                ) from None
            if kind is StructuredKind.JSON_SCHEMA and not isinstance(value, dict | bool):
                raise InvalidRequestError("structured output json_schema: not a JSON Schema")
            if kind is StructuredKind.CHOICE and (
                not isinstance(value, list)
                or not value
                or not all(isinstance(c, str) and c for c in value)
            ):
                raise InvalidRequestError(
                    "structured output choice: the spec must be a non-empty array of "
                    "non-empty strings"
                )

"""The issue 39 benches' pure parts: the JSON schemas grow in nesting and are valid schemas,
and the constrained-ITL verdict compares the move against the plain runs' spread."""

from __future__ import annotations

import json

import jsonschema

from bench.constrained_itl import Phase, report
from bench.openai_features import SCHEMAS, schema


def _depth(s: dict) -> int:
    child = s.get("properties", {}).get("child")
    return 1 + (_depth(child) if isinstance(child, dict) and child.get("type") == "object" else 0)


def test_the_schemas_are_valid_and_grow_deeper() -> None:
    schemas = [schema(level) for level in range(1, SCHEMAS + 1)]
    for s in schemas:
        jsonschema.Draft202012Validator.check_schema(s)
        json.dumps(s)
    depths = [_depth(s) for s in schemas]
    assert depths == sorted(depths) and depths[-1] >= 10


def _phase(kind: str, p50: float) -> Phase:
    return Phase(kind, [p50] * 99 + [p50 * 2])


def test_the_verdict_is_the_move_against_the_plain_spread() -> None:
    plain = [_phase("plain", v) for v in (40.0, 44.0, 42.0)]  # spread 4 ms
    text, ok = report([*plain, *(_phase("mixed", v) for v in (43.0, 45.0, 41.0))])
    assert ok and "within" in text
    text, ok = report([*plain, *(_phase("mixed", v) for v in (50.0, 49.0, 51.0))])
    assert not ok and "BEYOND" in text

"""Structured outputs (``engine.grammar``): the mask row by row, the matcher's replay and
termination, the real model's JSON validating against 20 schemas of growing nesting, regex
and choice, logprobs kept raw, a constrained stream resumed elsewhere continuing exactly,
and the disaggregated roles giving the colocated tokens."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest
import torch

from engine import grammar
from engine.checkpoint import Checkpoint
from engine.errors import InvalidRequestError
from engine.grammar import Grammars
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.structured import StructuredKind as K
from engine.structured import StructuredOutput
from engine.tokenizer import Tokenizer
from services.common.convert import sampling_from_proto, sampling_to_proto
from tests.engine.conftest import engine_factory
from tests.engine.test_batch_invariant import _resumed
from tests.engine.test_disagg_roles import _disaggregated

VOCAB = 49152
# The packed quantized weights, batch-invariant: the fast engine here, and the one whose
# resumed streams continue exactly.
_QUANTIZED = {"weights": "quantized", "kv_cache_dtype": "float16", "batch_invariant": True}


def _so(kind: K, spec: object = "") -> StructuredOutput:
    return StructuredOutput(kind, spec if isinstance(spec, str) else json.dumps(spec))


def _prompt(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


@pytest.fixture(scope="module")
def grammars(default_tokenizer: Tokenizer) -> Grammars:
    return Grammars(default_tokenizer, VOCAB)


def _allowed(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(row != -torch.inf).flatten().tolist())


def test_the_mask_keeps_only_what_the_grammar_allows(grammars, default_tokenizer) -> None:
    tok = default_tokenizer
    choice = _so(K.CHOICE, ["yes", "no"])
    seqs = [Sequence("a", [1], SamplingParams(), 0.0), Sequence("b", [1], SamplingParams(), 0.0)]
    seqs[1].grammar = grammars.matcher(choice)
    logits = torch.randn(2, VOCAB)
    raw = logits.clone()
    out = grammar.mask(logits, seqs)
    assert torch.equal(logits, raw)  # the raw logits are the sampler's for logprobs
    assert torch.equal(out[0], raw[0])  # an unconstrained row is untouched
    allowed = _allowed(out[1])
    assert {tok.token_bytes(t) for t in allowed} == {b"y", b"ye", b"yes", b"n", b"no"}
    assert torch.equal(out[1, sorted(allowed)], raw[1, sorted(allowed)])
    assert grammar.mask(logits, seqs[:1]) is logits  # nothing constrained: no copy
    # after "yes" the grammar is complete: only the end is left
    m = seqs[1].grammar
    assert m.accept(tok.encode("yes", add_special_tokens=False)[0])
    assert m.complete
    assert _allowed(grammar.mask(logits, seqs)[1]) == set(tok.eos_token_ids)


def test_each_constrained_row_gets_its_own_grammars_mask(grammars, default_tokenizer) -> None:
    """Several constrained rows, unconstrained ones between them: each row's mask is its own
    matcher's (the fill writes row after row of one bitmask)."""
    tok = default_tokenizer
    seqs = [Sequence(k, [1], SamplingParams(), 0.0) for k in "abcd"]
    seqs[0].grammar = grammars.matcher(_so(K.CHOICE, ["yes", "no"]))
    seqs[2].grammar = grammars.matcher(_so(K.CHOICE, ["red", "blue"]))
    seqs[3].grammar = grammars.matcher(_so(K.CHOICE, ["yes", "no"]))
    logits = torch.randn(4, VOCAB)
    out = grammar.mask(logits, seqs)
    yes_no = {b"y", b"ye", b"yes", b"n", b"no"}
    assert {tok.token_bytes(t) for t in _allowed(out[0])} == yes_no
    assert torch.equal(out[1], logits[1])
    colours = {tok.token_bytes(t) for t in _allowed(out[2])}
    assert b"red" in colours and b"blue" in colours and not colours & yes_no
    assert {tok.token_bytes(t) for t in _allowed(out[3])} == yes_no


def test_a_bad_spec_or_resume_is_refused_by_name(grammars, default_tokenizer) -> None:
    for so, needle in [
        (_so(K.REGEX, "[a-"), "regex"),
        (_so(K.GRAMMAR, "start: foo"), "foo"),
        (_so(K.JSON_SCHEMA, {"type": "strin"}), "strin"),
    ]:
        with pytest.raises(InvalidRequestError, match=needle):
            grammars.matcher(so)
    tok = default_tokenizer
    digits = _so(K.REGEX, "[0-9]{3}")
    ids = tok.encode("123", add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match=r"resume_token_ids\[0\].*not allowed"):
        grammars.matcher(digits, tok.encode("ab", add_special_tokens=False))
    with pytest.raises(InvalidRequestError, match="nothing to resume"):
        grammars.matcher(digits, ids)
    m = grammars.matcher(digits, ids[:1])  # a prefix replays to where it stands
    assert not m.complete and not m.failed


def test_the_proto_carries_the_constraint() -> None:
    for so in (_so(K.JSON_OBJECT), _so(K.JSON_SCHEMA, {"type": "object"}), _so(K.REGEX, "a+")):
        p = SamplingParams(max_tokens=9, structured=so)
        assert sampling_from_proto(sampling_to_proto(p)) == p


@pytest.fixture(scope="module")
def engine(quantized_checkpoint: Checkpoint, default_tokenizer: Tokenizer) -> LLMEngine:
    cfg = EngineConfig(num_kv_blocks=512, max_num_seqs=32, **_QUANTIZED)  # type: ignore[arg-type]
    return LLMEngine(cfg, checkpoint=quantized_checkpoint, tokenizer=default_tokenizer)


def _obj(props: dict, **extra: object) -> dict:
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False, **extra}  # fmt: skip


NAME = {"type": "string", "maxLength": 12}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}
TAGS = {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2}
CITY = _obj({"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})
# 20 schemas, flat to nested: scalars, enums, arrays, objects in objects, arrays of objects
SCHEMAS: list[tuple[str, dict]] = [
    ("a person's name", _obj({"name": NAME})),
    ("a person", _obj({"name": NAME, "age": AGE})),
    (
        "a product",
        _obj(
            {
                "title": NAME,
                "price": {"type": "number", "minimum": 0, "maximum": 1000},
                "in_stock": {"type": "boolean"},
            }
        ),
    ),
    ("a colour", _obj({"colour": {"enum": ["red", "green", "blue"]}})),
    (
        "a task",
        _obj(
            {
                "task": NAME,
                "done": {"type": "boolean"},
                "priority": {"type": "integer", "minimum": 1, "maximum": 3},
            }
        ),
    ),
    ("a pet", _obj({"name": NAME, "kind": {"enum": ["cat", "dog"]}, "age": AGE})),
    ("a list of tags", _obj({"tags": TAGS})),
    ("a nullable note", _obj({"note": {"type": ["string", "null"], "maxLength": 12}})),
    (
        "a point",
        _obj(
            {
                "x": {"type": "integer", "minimum": -9, "maximum": 9},
                "y": {"type": "integer", "minimum": -9, "maximum": 9},
            }
        ),
    ),
    ("a user with an address", _obj({"name": NAME, "address": CITY})),
    ("a book", _obj({"title": NAME, "author": _obj({"name": NAME, "born": AGE})})),
    ("a post", _obj({"title": NAME, "tags": TAGS, "author": _obj({"name": NAME})})),
    ("an order", _obj({"id": AGE, "item": _obj({"sku": NAME, "qty": AGE})})),
    ("a line", _obj({"from": _obj({"x": AGE, "y": AGE}), "to": _obj({"x": AGE, "y": AGE})})),
    (
        "a team",
        _obj(
            {
                "name": NAME,
                "members": {"type": "array", "items": _obj({"name": NAME}), "maxItems": 2},
            }
        ),
    ),
    ("a company", _obj({"name": NAME, "office": _obj({"address": CITY})})),
    ("a tree", _obj({"root": _obj({"label": NAME, "child": _obj({"label": NAME})})})),
    (
        "a library",
        _obj(
            {
                "shelves": {
                    "type": "array",
                    "maxItems": 2,
                    "items": _obj(
                        {
                            "label": NAME,
                            "books": {"type": "array", "maxItems": 1, "items": _obj({"t": NAME})},
                        }
                    ),
                }
            }
        ),
    ),
    ("an event", _obj({"event": NAME, "where": _obj({"place": _obj({"address": CITY})})})),
    ("a nested config", _obj({"a": _obj({"b": _obj({"c": _obj({"d": {"enum": [1, 2]}})})})})),
]


def test_json_schema_outputs_parse_and_validate(engine, default_tokenizer) -> None:
    tok = default_tokenizer
    prompts = [_prompt(tok, f"Give me {what} as JSON.") for what, _ in SCHEMAS]
    params = [
        SamplingParams(max_tokens=128, temperature=0, structured=_so(K.JSON_SCHEMA, schema))
        for _, schema in SCHEMAS
    ]
    results = engine.generate(prompts, params)
    for (what, schema), r in zip(SCHEMAS, results, strict=True):
        assert r.finish_reason == "stop", (what, r.text)
        jsonschema.validate(json.loads(r.text), schema)
        assert r.token_ids[-1] not in tok.eos_token_ids  # ended by the grammar, not by EOS


def test_json_object_regex_and_choice(engine, default_tokenizer) -> None:
    tok = default_tokenizer
    cases = [
        ("Describe Paris as JSON.", _so(K.JSON_OBJECT)),
        ("What is a phone number?", _so(K.REGEX, r"[0-9]{3}-[0-9]{4}")),
        ("Is the sky blue?", _so(K.CHOICE, ["yes", "no"])),
        ("Say hi.", _so(K.GRAMMAR, 'start: "hi " NAME\nNAME: /[a-z]{1,6}/')),
    ]
    results = engine.generate(
        [_prompt(tok, q) for q, _ in cases],
        [SamplingParams(max_tokens=64, temperature=0, structured=so) for _, so in cases],
    )
    assert all(r.finish_reason == "stop" for r in results), [r.text for r in results]
    obj, phone, answer, hi = (r.text for r in results)
    assert isinstance(json.loads(obj), dict)
    assert phone[3] == "-" and (phone[:3] + phone[4:]).isdigit() and len(phone) == 8
    assert answer in ("yes", "no")
    assert hi.startswith("hi ") and hi[3:].isalpha()


def test_logprobs_stay_under_the_raw_distribution(engine, default_tokenizer) -> None:
    prompt = _prompt(default_tokenizer, "Is the sky blue?")
    params = SamplingParams(max_tokens=4, seed=3, structured=_so(K.CHOICE, ["maybe"]))
    r = engine.generate([prompt], params)[0]
    raw = torch.log_softmax(engine.prompt_logits(prompt), -1)[r.token_ids[0]].item()
    assert r.logprobs[0] == pytest.approx(raw, abs=1e-4)


@pytest.mark.parametrize("seed", [None, 11], ids=["greedy", "seeded"])
def test_a_constrained_stream_resumed_elsewhere_continues_exactly(
    engine, quantized_checkpoint, default_tokenizer, seed
) -> None:
    prompt = _prompt(default_tokenizer, "Give me a user with an address as JSON.")
    params = SamplingParams(
        max_tokens=64, temperature=0 if seed is None else 1.0, seed=seed,
        structured=_so(K.JSON_SCHEMA, SCHEMAS[9][1]),
    )  # fmt: skip
    full = engine.generate([prompt], params)[0]
    assert full.finish_reason == "stop" and len(full.token_ids) > 12
    other = LLMEngine(
        dataclasses.replace(engine.config, prefix_caching=False),
        checkpoint=quantized_checkpoint, tokenizer=default_tokenizer,
    )  # fmt: skip
    for cut in (1, 12):
        tokens, logprobs = _resumed(other, prompt, params, full.token_ids[:cut])
        assert tokens == full.token_ids[cut:], f"cut at {cut}"
        assert logprobs == full.logprobs[cut:], f"cut at {cut}"


@pytest.mark.parametrize("seed", [None, 5], ids=["greedy", "seeded"])
def test_disaggregated_roles_give_the_colocated_tokens(
    engine, quantized_checkpoint, default_tokenizer, seed
) -> None:
    prompts = [_prompt(default_tokenizer, f"Give me {w} as JSON.") for w in ("a pet", "a book")]
    params = SamplingParams(
        max_tokens=32, temperature=0 if seed is None else 0.8, seed=seed,
        structured=_so(K.JSON_SCHEMA, SCHEMAS[5][1]),
    )  # fmt: skip
    colocated = [r.token_ids for r in engine.generate(prompts, params)]
    make = engine_factory(quantized_checkpoint, default_tokenizer, **_QUANTIZED)
    got = _disaggregated(make(num_kv_blocks=64), make(), prompts, params)
    assert got == colocated
    for tokens in got:  # each ended by its grammar: whole JSON
        json.loads(default_tokenizer.decode(tokens))

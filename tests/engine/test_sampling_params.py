"""SamplingParams validation and the per-model checks."""

from __future__ import annotations

import dataclasses
import math

import pytest

from engine.errors import InvalidRequestError
from engine.sampling_params import MAX_STOP_STRINGS, SamplingParams

BAD_CASES = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 2.0),
    ("max_tokens", True),
    ("max_tokens", "16"),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1"),
    ("temperature", None),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.0001),
    ("top_p", math.nan),
    ("top_p", "0.9"),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", False),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("min_p", math.nan),
    ("seed", -1),
    ("seed", 1.0),
    ("seed", "7"),
    ("seed", True),
    ("seed", 2**64),
    ("stop", ("ok", "")),
    ("stop", ("ok", 3)),
    ("stop", [None]),
    ("stop", 5),
    ("stop", tuple(f"s{i}" for i in range(MAX_STOP_STRINGS + 1))),
    ("stop_token_ids", (1, -1)),
    ("stop_token_ids", (1.0,)),
    ("stop_token_ids", (True,)),
    ("stop_token_ids", 3),
    ("stop_token_ids", "12"),
    ("ignore_eos", 1),
    ("logprobs", "yes"),
]


@pytest.mark.parametrize(("field", "value"), BAD_CASES, ids=[f"{f}={v!r}" for f, v in BAD_CASES])
def test_bad_values_are_rejected_naming_field_and_value(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert field in message
    if not isinstance(value, tuple):
        assert repr(value) in message


GOOD_CASES = [
    {},
    {"max_tokens": 1},
    {"temperature": 0},
    {"temperature": 0.0, "top_k": 5, "top_p": 0.5},
    {"temperature": 2},
    {"top_k": -1},
    {"top_k": 0},
    {"top_k": 49152},
    {"top_p": 1e-9},
    {"top_p": 1},
    {"min_p": 0},
    {"min_p": 1.0},
    {"seed": 0},
    {"seed": 2**64 - 1},
    {"stop": tuple(f"s{i}" for i in range(MAX_STOP_STRINGS))},
    {"stop_token_ids": (0, 2, 49151)},
    {"ignore_eos": True, "logprobs": True},
]


@pytest.mark.parametrize("kwargs", GOOD_CASES, ids=[repr(k) for k in GOOD_CASES])
def test_good_values_are_accepted_and_kept(kwargs: dict[str, object]) -> None:
    params = SamplingParams(**kwargs)
    for field, value in kwargs.items():
        assert getattr(params, field) == value


def test_defaults() -> None:
    params = SamplingParams()
    assert params.max_tokens == 16
    assert params.temperature == 1.0
    assert (params.top_k, params.top_p, params.min_p) == (0, 1.0, 0.0)
    assert params.seed is None
    assert params.stop == () and params.stop_token_ids == ()
    assert not params.ignore_eos and not params.logprobs
    assert not params.greedy


def test_lists_are_normalised_to_tuples_and_object_is_hashable() -> None:
    params = SamplingParams(stop=["a", "bc"], stop_token_ids=[3, 4])
    assert params.stop == ("a", "bc")
    assert params.stop_token_ids == (3, 4)
    assert hash(params) == hash(SamplingParams(stop=("a", "bc"), stop_token_ids=(3, 4)))


def test_single_stop_string_is_one_entry_not_characters() -> None:
    assert SamplingParams(stop="###").stop == ("###",)


def test_numbers_are_stored_as_floats() -> None:
    params = SamplingParams(temperature=1, top_p=1, min_p=0)
    assert type(params.temperature) is float
    assert type(params.top_p) is float
    assert type(params.min_p) is float


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().max_tokens = 3  # type: ignore[misc]


def test_greedy_only_at_zero_temperature() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-6).greedy


def test_check_against_accepts_exact_fit() -> None:
    SamplingParams(max_tokens=8, stop_token_ids=(99,)).check_against(
        prompt_len=24, max_model_len=32, vocab_size=100
    )


def test_check_against_rejects_empty_prompt() -> None:
    with pytest.raises(InvalidRequestError, match="prompt_len=0"):
        SamplingParams().check_against(prompt_len=0, max_model_len=32, vocab_size=100)


def test_check_against_rejects_max_tokens_over_context() -> None:
    with pytest.raises(InvalidRequestError, match=r"max_tokens=33.*max_model_len=32"):
        SamplingParams(max_tokens=33).check_against(prompt_len=1, max_model_len=32, vocab_size=9)


def test_check_against_rejects_prompt_plus_max_tokens_over_context_stating_both() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(max_tokens=9).check_against(prompt_len=24, max_model_len=32, vocab_size=9)
    message = str(info.value)
    assert "prompt_len=24" in message
    assert "max_tokens=9" in message
    assert "max_model_len=32" in message


def test_check_against_rejects_stop_token_outside_vocab() -> None:
    params = SamplingParams(stop_token_ids=(5, 100))
    with pytest.raises(InvalidRequestError, match=r"stop_token_ids.*100.*vocab_size=100"):
        params.check_against(prompt_len=1, max_model_len=32, vocab_size=100)
    params.check_against(prompt_len=1, max_model_len=32, vocab_size=101)

"""OpenAI request parsing and preparation: every class of bad input gets a precise 4xx."""

from __future__ import annotations

import pytest

from engine.errors import CapacityError, InvalidRequestError, ResourceExhaustedError
from services.gateway.backend import BackendUnavailableError
from services.gateway.openai_api import (
    ApiError,
    Limits,
    decode_json_body,
    from_engine_error,
    parse_chat,
    parse_completion,
    prepare_chat,
    prepare_completion,
)
from services.gateway.served_model import ServedModel

M = "smol"
MODELS = {M}
LIMITS = Limits(default_max_tokens=16, default_chat_max_tokens=1024)
MAX_LEN = 64


@pytest.fixture(scope="module")
def model(default_tokenizer) -> ServedModel:
    return ServedModel(M, default_tokenizer, MAX_LEN, default_tokenizer.vocab_size)


def _err(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    return info.value


def _cmpl(**fields) -> dict:
    return {"model": M, "prompt": "Hello", **fields}


def _chat(**fields) -> dict:
    return {"model": M, "messages": [{"role": "user", "content": "Hi"}], **fields}


# -- the body itself -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "code", "needle"),
    [
        (b'{"model": "smol", "prompt": ', "invalid_json", "could not parse the JSON"),
        (b"", None, "empty"),
        (b'{"model": "smol", "temperature": NaN}', "invalid_json", "NaN is not valid JSON"),
        (b'{"x": ' + b"1" * 5000 + b"}", "invalid_json", "could not parse"),
        (b"[" * 100_000 + b"]" * 100_000, "invalid_json", "nested too deeply"),
        (b'{"prompt": "caf\xe9"}', "invalid_encoding", "not valid UTF-8"),
    ],
)
def test_undecodable_bodies(data: bytes, code: str | None, needle: str) -> None:
    err = _err(decode_json_body, data)
    assert err.status == 400
    assert err.code == code
    assert needle in err.message
    assert err.to_dict()["error"]["type"] == "invalid_request_error"


def test_error_json_shape() -> None:
    err = ApiError(400, "bad", param="max_tokens", code="invalid_type")
    assert err.to_dict() == {
        "error": {
            "message": "bad",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": "invalid_type",
        }
    }


@pytest.mark.parametrize("body", [[], "text", 3, None])
def test_body_must_be_an_object(body) -> None:
    err = _err(parse_completion, body, MODELS)
    assert (err.status, err.param) == (400, None)
    assert "must be a JSON object" in err.message


# -- model -----------------------------------------------------------------------------------


@pytest.mark.parametrize("parse", [parse_completion, parse_chat])
def test_model_missing_mistyped_unknown(parse) -> None:
    base = _cmpl() if parse is parse_completion else _chat()
    del base["model"]
    err = _err(parse, base, MODELS)
    assert (err.status, err.param, err.code) == (400, "model", "missing")
    err = _err(parse, {**base, "model": 7}, MODELS)
    assert (err.status, err.param, err.code) == (400, "model", "invalid_type")
    assert "expected a string, but got an integer" in err.message
    err = _err(parse, {**base, "model": "gpt-4"}, MODELS)
    assert (err.status, err.param, err.code) == (404, "model", "model_not_found")
    assert "`gpt-4` does not exist" in err.message


# -- completions fields ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"prompt": None}, "prompt", "Missing required parameter"),
        ({"prompt": ""}, "prompt", "must not be empty"),
        ({"prompt": []}, "prompt", "must not be empty"),
        ({"prompt": {"text": "x"}}, "prompt", "expected a string or an array of token ids"),
        ({"prompt": ["a", "b"]}, "prompt", "Batched prompts (2)"),
        ({"prompt": [[1], [2]]}, "prompt", "Batched prompts (2)"),
        ({"prompt": [1, "a"]}, "prompt[1]", "expected an integer token id"),
        ({"prompt": [1, True]}, "prompt[1]", "expected an integer token id"),
        ({"max_tokens": "10"}, "max_tokens", "expected an integer, but got a string"),
        ({"max_tokens": 10.5}, "max_tokens", "expected an integer, but got a number"),
        ({"max_tokens": 0}, "max_tokens", "less than the minimum of 1"),
        ({"max_tokens": True}, "max_tokens", "but got a boolean"),
        ({"temperature": "hot"}, "temperature", "expected a number"),
        ({"temperature": -1}, "temperature", "must be a finite number >= 0"),
        ({"top_p": 0}, "top_p", "must be a number in (0, 1]"),
        ({"top_p": 1.5}, "top_p", "must be a number in (0, 1]"),
        ({"top_k": 2.5}, "top_k", "expected an integer"),
        ({"top_k": -2}, "top_k", "integer >= -1"),
        ({"min_p": 2}, "min_p", "[0, 1]"),
        ({"seed": -1}, "seed", "integer in [0,"),
        ({"seed": "1"}, "seed", "expected an integer"),
        ({"stop": 5}, "stop", "a string or an array of strings"),
        ({"stop": ["ok", 3]}, "stop[1]", "expected a string"),
        ({"stop": [""]}, "stop", "not a non-empty string"),
        ({"stop": ["s"] * 17}, "stop", "at most 16"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids[1]", "expected an integer"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "not an integer >= 0"),
        ({"ignore_eos": "yes"}, "ignore_eos", "expected a boolean"),
        ({"stream": 1}, "stream", "expected a boolean, but got an integer"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when"),
        ({"stream": True, "stream_options": []}, "stream_options", "expected an object"),
        (
            {"stream": True, "stream_options": {"include_usage": "y"}},
            "stream_options.include_usage",
            "expected a boolean",
        ),
        ({"n": 0}, "n", "minimum of 1"),
        ({"n": 17}, "n", "at most 16"),
        ({"n": "2"}, "n", "expected an integer"),
        ({"best_of": 3}, "best_of", "use n"),
        ({"echo": True, "logprobs": 0}, "echo", "prompt tokens' log-probabilities"),
        ({"echo": 1}, "echo", "expected a boolean"),
        ({"suffix": "end"}, "suffix", "'suffix' is not supported"),
        ({"logprobs": 9}, "logprobs", "at most 5"),
        ({"include_stop_str_in_output": "y"}, "include_stop_str_in_output", "a boolean"),
        ({"logprobs": True}, "logprobs", "expected an integer"),
        ({"presence_penalty": 2.5}, "presence_penalty", "in [-2, 2]"),
        ({"frequency_penalty": "x"}, "frequency_penalty", "expected a number"),
        ({"frequency_penalty": -3}, "frequency_penalty", "in [-2, 2]"),
        ({"repetition_penalty": 0}, "repetition_penalty", "> 0"),
        ({"logit_bias": [1]}, "logit_bias", "an object mapping token ids"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "keys are token ids"),
        ({"logit_bias": {"5": "1"}}, "logit_bias['5']", "expected a number"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "in [-100, 100]"),
        ({"min_tokens": -1}, "min_tokens", "less than the minimum"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "[0, max_tokens]"),
    ],
)
def test_completion_field_errors(fields: dict, param: str, needle: str) -> None:
    err = _err(parse_completion, _cmpl(**fields), MODELS)
    assert err.status == 400, err
    assert err.param == param, err
    assert needle in err.message, err


def test_completion_accepts_the_openai_shapes() -> None:
    r = parse_completion(
        _cmpl(
            prompt=["Hi there"],
            max_tokens=5,
            temperature=0,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            seed=7,
            stop="\n",
            stream=True,
            stream_options={"include_usage": True},
            logprobs=0,
            n=1,
            echo=False,
            user="someone",
            presence_penalty=0,
            logit_bias={},
            unknown_field={"ignored": True},
        ),
        MODELS,
    )
    assert r.prompt == "Hi there"
    assert (r.max_tokens, r.stream, r.include_usage) == (5, True, True)
    p = r.params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.0, 0.9, 40, 0.05, 7)
    assert p.stop == ("\n",) and p.logprobs
    assert parse_completion(_cmpl(prompt=[[1, 2, 3]]), MODELS).prompt == (1, 2, 3)
    assert parse_completion(_cmpl(prompt=[1, 2]), MODELS).prompt == (1, 2)
    plain = parse_completion(_cmpl(), MODELS)
    assert (plain.max_tokens, plain.stream, plain.params.logprobs) == (None, False, False)
    assert plain.params.temperature == 1.0


def test_alternatives_echo_and_kept_stop_strings_reach_the_request() -> None:
    r = parse_completion(_cmpl(logprobs=3, include_stop_str_in_output=True, stop="."), MODELS)
    assert (r.params.logprobs, r.params.top_logprobs, r.echo) == (True, 3, False)
    assert r.params.include_stop_str_in_output
    echoed = parse_completion(_cmpl(echo=True), MODELS)
    assert echoed.echo and not echoed.params.logprobs
    assert parse_completion(_cmpl(logprobs=0), MODELS).params.top_logprobs == 0
    chat = parse_chat(_chat(logprobs=True, top_logprobs=20), MODELS).params
    assert (chat.logprobs, chat.top_logprobs, chat.include_stop_str_in_output) == (True, 20, False)
    assert parse_chat(_chat(logprobs=False, top_logprobs=0), MODELS).params.top_logprobs == 0


def test_penalties_bias_and_min_tokens_reach_the_sampling_params() -> None:
    r = parse_completion(
        _cmpl(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.3,
              logit_bias={"7": -100, "3": 2.5}, min_tokens=3),
        MODELS,
    )  # fmt: skip
    p = r.params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.0, 1.3)
    assert p.logit_bias == ((3, 2.5), (7, -100.0)) and p.min_tokens == 3
    assert p.changes_logits and not parse_completion(_cmpl(), MODELS).params.changes_logits


# -- chat fields -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"messages": None}, "messages", "Missing required parameter"),
        ({"messages": "hi"}, "messages", "expected an array"),
        ({"messages": []}, "messages", "at least one message"),
        ({"messages": ["hi"]}, "messages[0]", "expected an object"),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "Missing required"),
        ({"messages": [{"role": 1, "content": "x"}]}, "messages[0].role", "expected a string"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "one of"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "Missing required"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "expected a"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].type",
            "only 'text' parts",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
            "messages[0].content[0].text",
            "expected a string",
        ),
        ({"max_completion_tokens": "5"}, "max_completion_tokens", "expected an integer"),
        ({"max_tokens": -3}, "max_tokens", "minimum of 1"),
        ({"logprobs": 1}, "logprobs", "expected a boolean"),
        ({"top_logprobs": 3}, "top_logprobs", "needs 'logprobs' to be true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "at most 20"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "minimum of 0"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "must be an object"),
        ({"response_format": {"type": "json_xml"}}, "response_format.type", "not supported"),
        ({"n": 17}, "n", "at most 16"),
    ],
)
def test_chat_field_errors(fields: dict, param: str, needle: str) -> None:
    err = _err(parse_chat, _chat(**fields), MODELS)
    assert err.status == 400, err
    assert err.param == param, err
    assert needle in err.message, err


def test_chat_accepts_parts_developer_role_and_max_completion_tokens() -> None:
    r = parse_chat(
        _chat(
            messages=[
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
            ],
            max_tokens=9,
            max_completion_tokens=4,
            logprobs=True,
            top_logprobs=0,
            response_format={"type": "text"},
            tools=[],
        ),
        MODELS,
    )
    assert [(m.role, m.content) for m in r.messages] == [
        ("system", "Be brief."),
        ("user", "a\nb"),
        ("assistant", ""),
    ]
    assert r.max_tokens == 4  # max_completion_tokens wins, as in OpenAI
    assert r.params.logprobs


# -- preparing against the model's limits ----------------------------------------------------


def test_prepare_completion_defaults_and_ids(model: ServedModel, default_tokenizer) -> None:
    inp = prepare_completion(parse_completion(_cmpl(), MODELS), model, "r1", LIMITS)
    assert inp.prompt_token_ids == tuple(default_tokenizer.encode("Hello"))
    assert inp.params.max_tokens == 16
    assert (inp.request_id, inp.model) == ("r1", M)
    ids = prepare_completion(parse_completion(_cmpl(prompt=[5, 6]), MODELS), model, "r", LIMITS)
    assert ids.prompt_token_ids == (5, 6)


def test_prepare_chat_default_max_tokens_is_the_rest_of_the_context(
    model: ServedModel, default_tokenizer
) -> None:
    inp = prepare_chat(parse_chat(_chat(), MODELS), model, "r", LIMITS)
    text = default_tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert inp.prompt_token_ids == tuple(default_tokenizer.encode(text, add_special_tokens=False))
    assert inp.params.max_tokens == MAX_LEN - len(inp.prompt_token_ids)
    capped = prepare_chat(parse_chat(_chat(), MODELS), model, "r", Limits(16, 5))
    assert capped.params.max_tokens == 5


@pytest.mark.parametrize(
    ("fields", "param", "code", "needle"),
    [
        ({"prompt": "word " * 100}, "prompt", "context_length_exceeded", "maximum context length"),
        ({"max_tokens": 1000}, "max_tokens", None, "exceeds max_model_len=64"),
        ({"max_tokens": 64}, "prompt", "context_length_exceeded", "1 in the prompt, 64 for"),
        ({"prompt": [0, 49152]}, "prompt", None, "prompt[1]=49152 is not a token id"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids", None, "outside the vocabulary"),
        ({"logit_bias": {"49152": 1}}, "logit_bias", None, "outside the vocabulary"),
        ({"min_tokens": 20}, "min_tokens", None, "[0, max_tokens]"),  # the default max_tokens 16
        ({"prompt": "bad \ud800 text"}, "prompt", None, "not valid Unicode"),
    ],
)
def test_prepare_completion_limits(
    model: ServedModel, fields: dict, param: str, code: str | None, needle: str
) -> None:
    req = parse_completion(_cmpl(**fields), MODELS)
    err = _err(prepare_completion, req, model, "r", LIMITS)
    assert (err.status, err.param, err.code) == (400, param, code), err
    assert needle in err.message, err


def test_prepare_chat_limits(model: ServedModel) -> None:
    long = parse_chat(_chat(messages=[{"role": "user", "content": "word " * 100}]), MODELS)
    err = _err(prepare_chat, long, model, "r", LIMITS)
    assert (err.status, err.param, err.code) == (400, "messages", "context_length_exceeded")
    surrogate = parse_chat(_chat(messages=[{"role": "user", "content": "\udc00"}]), MODELS)
    err = _err(prepare_chat, surrogate, model, "r", LIMITS)
    assert (err.status, err.param) == (400, "messages")
    assert "messages[0].content is not valid Unicode" in err.message
    tool_first = parse_chat(_chat(max_tokens=2000), MODELS)
    err = _err(prepare_chat, tool_first, model, "r", LIMITS)
    assert (err.status, err.param) == (400, "max_tokens")


def test_engine_errors_map_to_statuses() -> None:
    assert from_engine_error(InvalidRequestError("top_k=-5 is invalid: x")).param == "top_k"
    assert from_engine_error(CapacityError("too big")).status == 400
    busy = from_engine_error(ResourceExhaustedError("full"))
    assert (busy.status, busy.code) == (429, "rate_limit_exceeded")
    assert from_engine_error(BackendUnavailableError("down")).status == 503
    with pytest.raises(RuntimeError):
        from_engine_error(RuntimeError("bug"))

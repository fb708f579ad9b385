"""Bad input raises a clear, specific error, and leaves the engine usable."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.errors import CapacityError, InvalidRequestError, ModelLoadError
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        ([1, -4], SamplingParams(), "token"),
        ([1, 10**9], SamplingParams(), "token"),
        ("x " * 9000, SamplingParams(max_tokens=1), "8192"),
        ("hello", SamplingParams(max_tokens=9000), "max_tokens"),
        ("hello " * 4000, SamplingParams(max_tokens=4500), "8192"),
        ("hello", SamplingParams(stop_token_ids=(10**6,)), "stop_token_ids"),
    ],
)
def test_bad_requests_are_rejected(default_engine: LLMEngine, prompt, params, match) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        default_engine.add_request(prompt, params)
    assert not default_engine.has_unfinished()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_sampling_params(kwargs, match) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_engine_still_serves_after_rejections(default_engine: LLMEngine) -> None:
    with pytest.raises(InvalidRequestError):
        default_engine.add_request("")
    res = default_engine.generate(["The sky is"], SamplingParams(max_tokens=4, temperature=0))
    assert len(res[0].token_ids) == 4


def test_duplicate_request_id(default_engine: LLMEngine) -> None:
    default_engine.add_request("a", SamplingParams(max_tokens=1), request_id="dup")
    try:
        with pytest.raises(InvalidRequestError, match="dup"):
            default_engine.add_request("b", SamplingParams(max_tokens=1), request_id="dup")
    finally:
        default_engine.abort_request("dup")


def test_request_larger_than_kv_cache(make_engine) -> None:
    engine = make_engine(num_kv_blocks=4)
    with pytest.raises(CapacityError, match="blocks"):
        engine.add_request("hello " * 50, SamplingParams(max_tokens=40))


def test_unknown_model_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does-not-exist"):
        LLMEngine(EngineConfig(model=str(tmp_path / "does-not-exist.gguf")))


def test_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(ModelLoadError):
        LLMEngine(EngineConfig(model=str(bad)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"dtype": "int3"}, "dtype"), ({"block_size": 12}, "block_size")],
)
def test_bad_engine_config(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)

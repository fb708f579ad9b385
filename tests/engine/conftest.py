"""Shared fixtures: the real default model, loaded once per test session."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.checkpoint import Checkpoint, load_checkpoint
from engine.llm_engine import EngineConfig, LLMEngine
from engine.tokenizer import Tokenizer
from tests.engine.parity import Reference, hf_references, parity_prompts


@pytest.fixture(scope="session")
def default_checkpoint() -> Checkpoint:
    return load_checkpoint()


@pytest.fixture(scope="session")
def quantized_checkpoint() -> Checkpoint:
    """The default model with its GGUF's quantized tensors kept as packed blocks."""
    return load_checkpoint(quantized=True)


@pytest.fixture(scope="session")
def default_tokenizer(default_checkpoint: Checkpoint) -> Tokenizer:
    return Tokenizer.from_path(default_checkpoint.path)


@pytest.fixture(scope="session")
def hf_gguf_model(default_checkpoint: Checkpoint):
    """transformers' model on the same GGUF: the parity reference (test-only dependency)."""
    import transformers

    path = default_checkpoint.path
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def hf_gguf_references(hf_gguf_model, default_tokenizer: Tokenizer) -> list[Reference]:
    """transformers' greedy tokens and logits on the parity prompts, computed once."""
    prompts = parity_prompts(default_tokenizer)
    return hf_references(hf_gguf_model, prompts, default_tokenizer.eos_token_ids)


@pytest.fixture(scope="session")
def make_engine(
    default_checkpoint: Checkpoint, default_tokenizer: Tokenizer
) -> Callable[..., LLMEngine]:
    """Build an engine on the real model with config overrides, sharing loaded weights."""
    return engine_factory(default_checkpoint, default_tokenizer)


def engine_factory(
    checkpoint: Checkpoint, tokenizer: Tokenizer, **defaults: object
) -> Callable[..., LLMEngine]:
    """Engines on ``checkpoint`` with config overrides, ``defaults`` under them. The KV
    dtype is float32 unless told (the exact-parity mode; ``auto`` is float16 on the CPU)."""

    def make(**overrides: object) -> LLMEngine:
        config = {"num_kv_blocks": 512, "kv_cache_dtype": "float32", **defaults, **overrides}
        cfg = EngineConfig(**config)  # type: ignore[arg-type]
        return LLMEngine(cfg, checkpoint=checkpoint, tokenizer=tokenizer)

    return make


@pytest.fixture(scope="session")
def default_engine(make_engine: Callable[..., LLMEngine]) -> LLMEngine:
    return make_engine()


@pytest.fixture(scope="session")
def prompts(default_tokenizer: Tokenizer) -> list[list[int]]:
    """Three short chat prompts: the disaggregated-vs-colocated tests' workload."""
    qs = ["What is the capital of France?", "Write a limerick about a cat.", "2+2=?"]
    return [
        default_tokenizer.encode(
            default_tokenizer.apply_chat_template([{"role": "user", "content": q}])
        )
        for q in qs
    ]

"""Greedy output and logits equal Hugging Face transformers' on the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from engine.checkpoint import load_checkpoint
from engine.llm_engine import EngineConfig, LLMEngine
from engine.tokenizer import Tokenizer
from tests.engine.parity import (
    SUM_ORDER_TIE,
    Reference,
    check_parity,
    hf_references,
    parity_prompts,
)
from tests.engine.tiny_models import write_tiny_hf_checkpoint


def test_prompt_set_is_diverse(default_tokenizer: Tokenizer) -> None:
    prompts = parity_prompts(default_tokenizer)
    assert len(prompts) >= 8
    assert max(len(p) for p in prompts) >= 1000


def test_greedy_parity_default_gguf(
    default_engine: LLMEngine, hf_gguf_model, hf_gguf_references: list[Reference]
) -> None:
    # the same float32 numbers, summed by oneDNN and the C++ kernels or by transformers' ops
    prompts = parity_prompts(default_engine.tokenizer)
    check_parity(
        default_engine, prompts, hf_gguf_references, near_tie=(hf_gguf_model, SUM_ORDER_TIE)
    )


def test_greedy_parity_tiny_safetensors(tmp_path: Path, default_tokenizer: Tokenizer) -> None:
    model_dir = write_tiny_hf_checkpoint(tmp_path / "tiny", seed=3)
    ckpt = load_checkpoint(model_dir)
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), num_kv_blocks=256, kv_cache_dtype="float32"),
        checkpoint=ckpt,
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = parity_prompts(default_tokenizer)[:6]
    refs = hf_references(hf, prompts, engine.tokenizer.eos_token_ids)
    check_parity(engine, prompts, refs, near_tie=(hf, SUM_ORDER_TIE))

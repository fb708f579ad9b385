"""Greedy output and logits equal Hugging Face transformers' on the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from engine.checkpoint import load_checkpoint
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from tests.engine.tiny_models import write_tiny_hf_checkpoint

NEW_TOKENS = 64
LOGIT_RTOL = 1e-3

_LONG_TEXT = " ".join(
    f"Section {i}: the river town of Ellwood kept a ledger of every boat that passed, "
    f"noting its cargo ({['grain', 'timber', 'salt', 'wool', 'copper'][i % 5]}), its crew of "
    f"{3 + i % 7} and the toll of {i * 13 % 97} pennies paid at the lock."
    for i in range(40)
)

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a pirate who answers briefly."},
        {"role": "user", "content": "Tell me about the sea."},
    ],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "user", "content": "Summarize this ledger in two sentences:\n" + _LONG_TEXT}],
]
PLAIN_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "La Révolution française a commencé en",
    "中国的首都是",
    "The three primary colors are",
    "Привет! Как дела? Сегодня мы поговорим о",
]


def _prompts(tok: Tokenizer) -> list[list[int]]:
    out = [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True)) for m in CHAT_PROMPTS]
    out += [tok.encode(p) for p in PLAIN_PROMPTS]
    return out


def _hf_greedy(model, ids: list[int], eos: list[int]) -> tuple[list[int], torch.Tensor]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        logits = model(x).logits[0, -1].float()
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    return out[0, len(ids) :].tolist(), logits


def _truncate_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def _check(engine: LLMEngine, hf_model, prompts: list[list[int]]) -> None:
    eos = sorted(engine.tokenizer.eos_token_ids)
    ours = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    for ids, res in zip(prompts, ours, strict=True):
        ref_tokens, ref_logits = _hf_greedy(hf_model, ids, eos)
        ref_tokens = _truncate_at_eos(ref_tokens, set(eos))
        assert res.token_ids == ref_tokens, f"prompt of {len(ids)} tokens diverges"
        logits = engine.prompt_logits(ids)
        rel = (logits - ref_logits).abs().max() / ref_logits.abs().max()
        assert rel.item() <= LOGIT_RTOL, f"relative logit error {rel.item():.2e}"


def test_prompt_set_is_diverse(default_tokenizer: Tokenizer) -> None:
    prompts = _prompts(default_tokenizer)
    assert len(prompts) >= 8
    assert max(len(p) for p in prompts) >= 1000


def test_greedy_parity_default_gguf(default_engine: LLMEngine, hf_gguf_model) -> None:
    _check(default_engine, hf_gguf_model, _prompts(default_engine.tokenizer))


def test_greedy_parity_tiny_safetensors(tmp_path: Path, default_tokenizer: Tokenizer) -> None:
    model_dir = write_tiny_hf_checkpoint(tmp_path / "tiny", seed=3)
    ckpt = load_checkpoint(model_dir)
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=256), checkpoint=ckpt)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    _check(engine, hf, _prompts(default_tokenizer)[:6])

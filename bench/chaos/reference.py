"""The greedy reference: what the real engine, in this process, generates for each chat
question (the same chat template and tokenizer the gateway uses)."""

from __future__ import annotations

from collections.abc import Sequence


def greedy_texts(questions: Sequence[str], max_tokens: int) -> dict[str, str]:
    """question -> its greedy completion of at most ``max_tokens`` tokens (one batch)."""
    from engine.checkpoint import load_checkpoint  # lazy: keeps torch out of --help
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.tokenizer import Tokenizer

    unique = sorted(set(questions))
    ckpt = load_checkpoint()
    tok = Tokenizer.from_path(ckpt.path)
    engine = LLMEngine(
        EngineConfig(weights="float32", kv_cache_dtype="float32", num_kv_blocks=512),
        checkpoint=ckpt,
        tokenizer=tok,
    )
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in unique
    ]
    results = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return {q: r.text for q, r in zip(unique, results, strict=True)}

"""The parity prompt set and transformers' greedy references, shared by the parity tests
of float32 weights (tests/engine/test_parity.py) and packed quantized weights
(tests/engine/test_quantized_weights.py); and the rule greedy tokens computed two ways are
held to (``assert_greedy_equal``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

NEW_TOKENS = 64
LOGIT_RTOL = 1e-3
# Relative top-2 logit gap under which another float32 summation order may flip a greedy token.
SUM_ORDER_TIE = 1e-4

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


def parity_prompts(tok: Tokenizer) -> list[list[int]]:
    out = [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True)) for m in CHAT_PROMPTS]
    out += [tok.encode(p) for p in PLAIN_PROMPTS]
    return out


def hf_greedy(model, ids: list[int], eos: list[int]) -> tuple[list[int], torch.Tensor]:
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


def truncate_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


@dataclass(frozen=True)
class Reference:
    """transformers' greedy tokens (cut at the first EOS) and last-position prompt logits."""

    tokens: list[int]
    logits: torch.Tensor


def hf_references(hf_model, prompts: list[list[int]], eos: set[int]) -> list[Reference]:
    out = []
    for ids in prompts:
        tokens, logits = hf_greedy(hf_model, ids, sorted(eos))
        out.append(Reference(truncate_at_eos(tokens, eos), logits))
    return out


def check_parity(
    engine: LLMEngine,
    prompts: list[list[int]],
    refs: list[Reference],
    *,
    near_tie: tuple[object, float] | None = None,
) -> None:
    """Greedy tokens equal and prompt logits within LOGIT_RTOL. ``near_tie=(hf_model, gap)``
    lets a prompt diverge only where transformers' own top two logits are within ``gap``
    (relative): float32 summation order decides such a token; the rest is then not
    compared, since the contexts differ."""
    ours = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    for ids, res, ref in zip(prompts, ours, refs, strict=True):
        logits = engine.prompt_logits(ids)
        rel = (logits - ref.logits).abs().max() / ref.logits.abs().max()
        assert rel.item() <= LOGIT_RTOL, f"relative logit error {rel.item():.2e}"
        if res.token_ids == ref.tokens or near_tie is None:
            assert res.token_ids == ref.tokens, f"prompt of {len(ids)} tokens diverges"
            continue
        hf_model, gap_limit = near_tie
        at = next(
            i for i, (a, b) in enumerate(zip(res.token_ids, ref.tokens, strict=False)) if a != b
        )
        with torch.inference_mode():
            step = hf_model(torch.tensor([ids + ref.tokens[:at]])).logits[0, -1].float()  # type: ignore[operator]
        gap = top2_gap(step)
        assert gap < gap_limit, f"diverged at token {at} where the top-2 gap is {gap:.2e}"


def top2_gap(logits: torch.Tensor) -> float:
    """The gap between the top two logits, as a fraction of the largest |logit|."""
    top2 = logits.topk(2).values
    return (top2[0] - top2[1]).item() / logits.abs().max().item()


def assert_greedy_equal(
    engine: LLMEngine,
    prompts: list[list[int]] | list[str],
    got: list[list[int]],
    want: list[list[int]],
    *,
    gap: float = SUM_ORDER_TIE,
) -> None:
    """Greedy tokens of ``prompts`` computed two ways (batched and alone, chunked, from the
    prefix cache, other kernels) are equal, except that a sequence may diverge where
    ``engine``'s top two logits are within ``gap`` (relative): the two ways add float32 terms
    in orders torch's GEMM picks by shape and ISA, which decides such a token; the rest is
    then not compared, since the contexts differ."""
    assert len(got) == len(want) == len(prompts)
    for prompt, g, w in zip(prompts, got, want, strict=True):
        ids = engine.encode_prompt(prompt)
        at = next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), None)
        if at is None:
            assert g == w, f"prompt of {len(ids)} tokens gives {len(g)} tokens, want {len(w)}"
            continue
        step = top2_gap(engine.prompt_logits([*ids, *w[:at]]))
        assert step < gap, f"prompt of {len(ids)} tokens diverges at {at}, top-2 gap {step:.2e}"

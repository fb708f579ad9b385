"""Batching is invisible: a sequence's tokens do not depend on what it is batched with.

A batch, a chunk or a cache hit runs torch's GEMM over other shapes than a sequence alone
does, so its float32 sums may differ in the last bits: tokens are held to
``assert_greedy_equal`` (equal, but at a near-tie of the logits).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from tests.engine.parity import assert_greedy_equal

N_TOKENS = 24

SHARED = (
    "You are a careful assistant for a public library. Answer in plain language, cite the "
    "shelf section when you can, and keep every answer under three sentences. "
)
QUESTIONS = [
    "Where are the atlases?",
    "Do you lend telescopes?",
    "How long can I keep a novel?",
    "What is a call number?",
    "Can children use the computers alone after school on weekdays?",
    "Is there a quiet room?",
    "Explain interlibrary loans, including fees, waiting times, and what happens if a "
    "book arrives damaged or is lost in transit between the branches, and whether the "
    "same rules apply to audiobooks, sheet music, maps and rare volumes from other cities.",
    "Hi",
    "Where do I return DVDs?",
    "Who picks new books for the poetry shelf, and how can readers suggest titles?",
    "What does the library do with old newspapers?",
    "Are pets allowed?",
    "When does the reading club meet and what are they reading this month?",
    "Can I print in color?",
    "List three ways to find a book by subject.",
    "Why?",
]


def _prompts(tok: Tokenizer) -> list[list[int]]:
    out = []
    for q in QUESTIONS:
        msgs = [{"role": "system", "content": SHARED}, {"role": "user", "content": q}]
        out.append(tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True)))
    return out


GREEDY = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(make_engine: Callable[..., LLMEngine], default_tokenizer: Tokenizer) -> list[list[int]]:
    engine = make_engine(prefix_caching=False)
    return [engine.generate([p], GREEDY)[0].token_ids for p in _prompts(default_tokenizer)]


def test_prompts_have_mixed_lengths(default_tokenizer: Tokenizer) -> None:
    lens = [len(p) for p in _prompts(default_tokenizer)]
    assert len(lens) == 16 and max(lens) - min(lens) > 30


def test_batch_of_16_equals_alone(make_engine, default_tokenizer, alone) -> None:
    engine = make_engine(prefix_caching=False)
    prompts = _prompts(default_tokenizer)
    res = engine.generate(prompts, GREEDY)
    assert_greedy_equal(engine, prompts, [r.token_ids for r in res], alone)


def test_chunked_prefill_equals_alone(make_engine, default_tokenizer, alone) -> None:
    engine = make_engine(prefix_caching=False, chunked_prefill=48)
    prompts = _prompts(default_tokenizer)
    res = engine.generate(prompts, GREEDY)
    assert_greedy_equal(engine, prompts, [r.token_ids for r in res], alone)


def test_cached_prefix_equals_alone(make_engine, default_tokenizer, alone) -> None:
    engine = make_engine(prefix_caching=True)
    prompts = _prompts(default_tokenizer)
    warm = engine.generate([prompts[0]], GREEDY)[0]
    assert warm.token_ids == alone[0]
    res = engine.generate(prompts, GREEDY)
    assert all(r.num_cached_tokens >= 32 for r in res), [r.num_cached_tokens for r in res]
    assert_greedy_equal(engine, prompts, [r.token_ids for r in res], alone)


def test_cached_prefix_with_chunked_prefill_equals_alone(
    make_engine, default_tokenizer, alone
) -> None:
    engine = make_engine(prefix_caching=True, chunked_prefill=40)
    prompts = _prompts(default_tokenizer)
    engine.generate([prompts[3]], GREEDY)
    res = engine.generate(prompts, GREEDY)
    assert sum(r.num_cached_tokens for r in res) > 0
    assert_greedy_equal(engine, prompts, [r.token_ids for r in res], alone)


def test_preemption_under_kv_pressure_equals_alone(make_engine, default_tokenizer, alone) -> None:
    # 16 sequences of ~80-140 tokens need ~110 blocks at the end; 60 forces preemption.
    engine = make_engine(prefix_caching=False, num_kv_blocks=60)
    prompts = _prompts(default_tokenizer)
    res = engine.generate(prompts, GREEDY)
    assert engine.num_preemptions > 0
    assert_greedy_equal(engine, prompts, [r.token_ids for r in res], alone)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_seeded_sampling_reproduces_across_runs_and_batches(make_engine, default_tokenizer) -> None:
    prompts = _prompts(default_tokenizer)
    seeded = SamplingParams(
        max_tokens=N_TOKENS, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True
    )
    e1 = make_engine()
    solo = e1.generate([prompts[5]], seeded)[0].token_ids
    e2 = make_engine()
    again = e2.generate([prompts[5]], seeded)[0].token_ids
    assert solo == again
    mixed = [
        SamplingParams(max_tokens=N_TOKENS, temperature=1.0, seed=i, ignore_eos=True)
        if i % 3 == 0
        else SamplingParams(max_tokens=N_TOKENS - i, temperature=0.7, ignore_eos=True)
        if i % 3 == 1
        else GREEDY
        for i in range(8)
    ]
    mixed[5] = seeded
    res = e2.generate(prompts[:8], mixed)
    assert res[5].token_ids == solo
    other = SamplingParams(
        max_tokens=N_TOKENS, temperature=0.9, top_p=0.95, seed=4321, ignore_eos=True
    )
    assert e2.generate([prompts[5]], other)[0].token_ids != solo

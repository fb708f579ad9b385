"""Batch-invariant mode (``EngineConfig(batch_invariant=True)``): a token's logits are the
same bits whatever shares its step, and whether it was decoded or prefilled, in one piece or
in chunks, by an engine on more threads or fewer. So a stream prefilled again from its prompt
plus the tokens it already has (a migration) continues with the very logits it would have
had, and a seeded stream with the very tokens.

Measured on the default model before this mode (issue 38): of 870 resumed positions, 47 had
the uninterrupted run's logprob bit for bit; ``test_without_it_the_resumed_logprobs_differ``
keeps that failure visible.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.checkpoint import Checkpoint
from engine.forward_batch import DecodeBatch, ForwardBatch, PrefillSegment
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model import LlamaModel
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from kernels import layer_ops

QUESTIONS = [
    "Write a story about a dragon.",
    "Explain how rainbows form.",
    "List ten fruits and their colors.",
    "Describe the ocean at night.",
    "What is the history of Rome?",
]
MAX_TOKENS = 28
CUTS = (3, 15)


@pytest.fixture(scope="module")
def prompts(default_tokenizer: Tokenizer) -> list[list[int]]:
    tok = default_tokenizer
    return [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS
    ]


def _params(i: int) -> SamplingParams:
    # different lengths: the running batch shrinks 5 -> 1 as streams end (the products cross
    # from the many-row kernel to the few-row one on the way)
    return SamplingParams(
        max_tokens=MAX_TOKENS - 3 * i, temperature=1.0, top_p=0.95, seed=100 + i, ignore_eos=True
    )


@pytest.fixture(scope="module")
def make(
    quantized_checkpoint: Checkpoint, default_tokenizer: Tokenizer
) -> Callable[..., LLMEngine]:
    def make(batch_invariant: bool, **overrides: object) -> LLMEngine:
        cfg = EngineConfig(
            weights="quantized", kv_cache_dtype="float16", num_kv_blocks=256,
            batch_invariant=batch_invariant, **overrides,  # type: ignore[arg-type]
        )  # fmt: skip
        return LLMEngine(cfg, checkpoint=quantized_checkpoint, tokenizer=default_tokenizer)

    return make


def _resumed(engine: LLMEngine, prompt: list[int], params: SamplingParams, done: list[int]):
    rid = engine.add_request(prompt, params, resumed=done)
    tokens: list[int] = []
    logprobs: list[float] = []
    while engine.has_unfinished():
        for ev in engine.step():
            assert ev.request_id == rid
            tokens.extend(ev.new_token_ids)
            logprobs.extend(ev.new_logprobs)
    return tokens, logprobs


def _compare(make, prompts, batch_invariant: bool) -> tuple[int, int, int]:
    """Run the streams together; resume each at ``CUTS`` on another engine (no prefix cache,
    prompts cut into 16-token chunks, one thread). Returns (positions compared, logprobs
    equal, token divergences)."""
    original = make(batch_invariant).generate(prompts, [_params(i) for i in range(len(prompts))])
    other = make(
        batch_invariant, prefix_caching=False, chunked_prefill=16,
    )  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    compared = equal = diverged = 0
    try:
        for i, run in enumerate(original):
            for cut in CUTS:
                tokens, logprobs = _resumed(other, prompts[i], _params(i), run.token_ids[:cut])
                if tokens != run.token_ids[cut:]:
                    diverged += 1
                for a, b in zip(logprobs, run.logprobs[cut:], strict=False):
                    compared += 1
                    equal += a == b
    finally:
        torch.set_num_threads(threads)
    return compared, equal, diverged


def test_a_resumed_stream_has_the_logits_and_tokens_of_the_uninterrupted_one(make, prompts) -> None:
    compared, equal, diverged = _compare(make, prompts, batch_invariant=True)
    assert compared > 50
    assert (equal, diverged) == (compared, 0)


def test_without_it_the_resumed_logprobs_differ(make, prompts) -> None:
    """The default engine (few-row and many-row kernels, torch's attention for prompts) gives
    a resumed stream's positions other low bits: what the mode fixes."""
    compared, equal, _ = _compare(make, prompts, batch_invariant=False)
    assert equal < compared


def test_every_row_as_a_decode_row() -> None:
    """Prefill rows become one query each over their own context; decode rows stay."""
    batch = ForwardBatch(
        input_ids=torch.zeros(6, dtype=torch.int64),
        positions=torch.zeros(6, dtype=torch.int64),
        slot_blocks=torch.zeros(6, dtype=torch.int64),
        slot_offsets=torch.zeros(6, dtype=torch.int64),
        prefills=(
            PrefillSegment(0, 3, 0, torch.tensor([7])),
            PrefillSegment(3, 2, 16, torch.tensor([4, 5])),
        ),
        decode=DecodeBatch(5, torch.tensor([[9, 8, 6]]), torch.tensor([40]), 40),
        logits_indices=torch.tensor([2, 4, 5]),
    )
    rows = batch.as_decode_rows()
    assert rows.context_lens.tolist() == [1, 2, 3, 17, 18, 40]
    assert rows.block_tables.tolist() == [
        [7, 0, 0], [7, 0, 0], [7, 0, 0], [4, 5, 0], [4, 5, 0], [9, 8, 6],
    ]  # fmt: skip
    assert rows.max_context_len == 40 and rows.start == 0


def test_row_sums_are_the_same_bits_alone_in_a_batch_and_on_any_thread_count() -> None:
    x = torch.rand(6, 49_153, generator=torch.Generator().manual_seed(0)) * 3
    together = layer_ops.row_sums(x)
    torch.testing.assert_close(together, x.double().sum(-1).float(), rtol=1e-6, atol=0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([layer_ops.row_sums(x[i : i + 1]) for i in range(6)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, together)


def test_a_rows_logprob_does_not_depend_on_its_batch() -> None:
    logits = torch.randn(5, 49_152, generator=torch.Generator().manual_seed(1)) * 4
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(5)]
    both = Sampler()(logits, params, [torch.Generator().manual_seed(i) for i in range(5)])
    for i in range(5):
        one = Sampler()(logits[i : i + 1], params[i : i + 1], [torch.Generator().manual_seed(i)])
        assert one.token_ids.tolist() == [both.token_ids[i].item()]
        assert one.logprobs.tolist() == [both.logprobs[i].item()]


def test_it_needs_packed_weights_on_the_cpu(default_checkpoint: Checkpoint) -> None:
    with pytest.raises(ValueError, match="batch_invariant runs packed quantized"):
        EngineConfig(weights="float32", batch_invariant=True)
    ck = default_checkpoint  # float32 tensors
    with pytest.raises(ValueError, match="needs every product on packed quantized weights"):
        LlamaModel(ck.config, ck.tensors, batch_invariant=True)
    with pytest.raises(ValueError, match="runs the compiled CPU kernels"):
        LlamaModel(ck.config, ck.tensors, batch_invariant=True, cpu_kernels=False)

"""Penalties, logit_bias and min_tokens (``engine.penalties``): the arithmetic row by row,
what they do to the real model's output, logprobs kept under the raw distribution, the proto
round trip, and a penalised stream that migrates (prefilled again from prompt + resumed
tokens) continuing exactly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import penalties
from engine.checkpoint import Checkpoint
from engine.errors import InvalidRequestError
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer
from services.common.convert import sampling_from_proto, sampling_to_proto
from tests.engine.test_batch_invariant import _resumed


def _seq(params: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> Sequence:
    return Sequence("r", prompt_ids, params, 0.0, output_ids=output_ids)


def test_each_change_is_the_formula_on_its_row() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    p = SamplingParams(
        presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
        logit_bias={2: 1.5, 5: -100.0}, min_tokens=4, stop_token_ids=[1],
    )  # fmt: skip
    rows = [
        _seq(p, prompt_ids=[0, 4], output_ids=[3, 3, 2]),
        _seq(SamplingParams(), prompt_ids=[0], output_ids=[1]),
    ]
    out = penalties.apply(logits, rows, eos_ids={4})
    want = logits[0].clone()
    want[[1, 4]] = -torch.inf  # 3 tokens out of min_tokens=4: the stop id and EOS barred
    want[2] += 1.5
    want[5] += -100.0
    for t in (0, 4, 3, 2):  # seen in prompt or output: positive / 2, negative * 2
        want[t] = want[t] / 2 if want[t] > 0 else want[t] * 2
    want[3] -= 0.25 * 2 + 0.5  # twice in the output
    want[2] -= 0.25 * 1 + 0.5
    assert torch.equal(out[0], want)
    assert torch.equal(out[1], logits[1])  # a row asking for nothing is untouched
    assert torch.equal(logits[1], torch.ones(6))  # and the input is not modified
    plain = [_seq(SamplingParams(), [0], [1])] * 2
    assert penalties.apply(logits, plain, {4}) is logits
    ignoring = dataclasses.replace(p, ignore_eos=True)
    barred = penalties.apply(logits[:1], [_seq(ignoring, [0], [])], {4})[0]
    assert barred[1] == -torch.inf and barred[4] != -torch.inf  # EOS stays when ignored


def test_bad_values_are_refused_by_name() -> None:
    for kwargs, needle in [
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"logit_bias": {1: 200}}, "logit_bias"),
        ({"logit_bias": {i: 1 for i in range(1025)}}, "logit_bias"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ]:
        with pytest.raises(InvalidRequestError, match=needle):
            SamplingParams(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        SamplingParams(logit_bias={50_000: 1}).check_against(
            prompt_len=3, max_model_len=100, vocab_size=49_152
        )


def test_the_proto_carries_every_field() -> None:
    p = SamplingParams(
        max_tokens=9, presence_penalty=0.5, frequency_penalty=-1.25, repetition_penalty=1.5,
        logit_bias={3: 2.5, 9: -100}, min_tokens=2, seed=4, logprobs=True, top_logprobs=5,
        include_stop_str_in_output=True, stop=("\n",),
    )  # fmt: skip
    assert sampling_from_proto(sampling_to_proto(p)) == p
    assert sampling_from_proto(sampling_to_proto(SamplingParams())) == SamplingParams()


@pytest.fixture(scope="module")
def engine(quantized_checkpoint: Checkpoint, default_tokenizer: Tokenizer) -> LLMEngine:
    cfg = EngineConfig(weights="quantized", kv_cache_dtype="float16", num_kv_blocks=256,
                       batch_invariant=True)  # fmt: skip
    return LLMEngine(cfg, checkpoint=quantized_checkpoint, tokenizer=default_tokenizer)


def _prompt(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def test_bias_and_min_tokens_steer_the_real_model(engine, default_tokenizer) -> None:
    tok = default_tokenizer
    prompt = _prompt(tok, "What is 2+2? Answer with one number.")
    base = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0))[0]
    assert base.finish_reason == "stop" and len(base.token_ids) < 20  # a short answer
    # min_tokens: EOS is barred until 20 tokens are out
    floor = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0,
                                                     min_tokens=20))[0]  # fmt: skip
    eos = set(tok.eos_token_ids)
    assert len(floor.token_ids) >= 20 and not eos & set(floor.token_ids[:19])
    # +100 forces a token at every step; -100 bans the greedy first token
    forced = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0,
                                                      logit_bias={42: 100}))[0]  # fmt: skip
    assert forced.token_ids == [42] * 5
    # logprobs stay those of the model's own distribution: the forced token is unlikely
    raw = torch.log_softmax(engine.prompt_logits(prompt), -1)[42].item()
    assert forced.logprobs[0] == pytest.approx(raw, abs=1e-3) and raw < -5
    banned = engine.generate([prompt], SamplingParams(
        max_tokens=8, temperature=0, logit_bias={base.token_ids[0]: -100}))[0]  # fmt: skip
    assert banned.token_ids[0] != base.token_ids[0]


def test_a_frequency_penalty_repeats_less(engine, default_tokenizer) -> None:
    prompt = _prompt(default_tokenizer, "Write the word cat thirty times, separated by spaces.")
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    plain = engine.generate([prompt], params)[0].token_ids
    penalised = engine.generate([prompt], dataclasses.replace(params, frequency_penalty=1.0))[
        0
    ].token_ids
    assert max(penalised.count(t) for t in penalised) < max(plain.count(t) for t in plain)


@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
def test_a_penalised_stream_resumed_elsewhere_continues_exactly(
    engine, quantized_checkpoint, default_tokenizer, seed
) -> None:
    prompt = _prompt(default_tokenizer, "Tell me a story about a lighthouse keeper.")
    params = SamplingParams(
        max_tokens=32, temperature=0 if seed is None else 1.0, seed=seed, ignore_eos=True,
        presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.2,
        logit_bias={13: -5.0}, min_tokens=24,
    )  # fmt: skip
    full = engine.generate([prompt], params)[0]
    other = LLMEngine(
        dataclasses.replace(engine.config, prefix_caching=False),
        checkpoint=quantized_checkpoint, tokenizer=default_tokenizer,
    )  # fmt: skip
    for cut in (1, 12):
        tokens, logprobs = _resumed(other, prompt, params, full.token_ids[:cut])
        assert tokens == full.token_ids[cut:], f"cut at {cut}"
        assert logprobs == full.logprobs[cut:], f"cut at {cut}"

"""Top logprobs (``engine.top_logprobs``) and ``include_stop_str_in_output`` on the real
model: the alternatives are the raw ``log_softmax`` of the model's logits, rows that do not
ask get none, and a stream resumed on another engine (a migration) continues with the same
alternatives and the same text, a matched stop string kept or cut alike."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.checkpoint import Checkpoint
from engine.errors import InvalidRequestError
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from engine.stop_checker import StopChecker
from engine.tokenizer import Tokenizer
from engine.top_logprobs import TopLogprobs

TOL = 1e-3  # logprobs of one step computed as a decode step vs a whole-prompt pass


@pytest.fixture(scope="module")
def engine(quantized_checkpoint: Checkpoint, default_tokenizer: Tokenizer) -> LLMEngine:
    cfg = EngineConfig(weights="quantized", kv_cache_dtype="float16", num_kv_blocks=256,
                       batch_invariant=True)  # fmt: skip
    return LLMEngine(cfg, checkpoint=quantized_checkpoint, tokenizer=default_tokenizer)


@pytest.fixture(scope="module")
def other(engine: LLMEngine, quantized_checkpoint, default_tokenizer) -> LLMEngine:
    """Where a stream migrates to: no prefix cache, so prompt + resumed tokens are computed."""
    cfg = dataclasses.replace(engine.config, prefix_caching=False)
    return LLMEngine(cfg, checkpoint=quantized_checkpoint, tokenizer=default_tokenizer)


def _prompt(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def _check_against_logits(top: TopLogprobs, logits: torch.Tensor, k: int) -> None:
    raw = torch.log_softmax(logits.double(), -1)
    want = torch.topk(raw, k + 1)
    assert len(top.token_ids) == len(top.logprobs) == k
    assert list(top.logprobs) == pytest.approx(want.values[:k].tolist(), abs=TOL)
    assert list(top.logprobs) == sorted(top.logprobs, reverse=True)
    for i, (got, lp) in enumerate(zip(top.token_ids, top.logprobs, strict=True)):
        assert raw[got].item() == pytest.approx(lp, abs=TOL)  # each id's own logprob
        near = [v for j, v in enumerate(want.values.tolist()) if j != i]
        if min(abs(v - want.values[i].item()) for v in near) > 2 * TOL:  # not tied
            assert got == want.indices[i].item()


def test_the_alternatives_are_the_raw_log_softmax_of_the_logits(engine, default_tokenizer):
    prompt = _prompt(default_tokenizer, "Name a colour of the rainbow.")
    # sampled at temperature 0.7 under a bias and a penalty: the alternatives stay the
    # model's own distribution, as the sampled token's logprob does
    params = SamplingParams(max_tokens=4, temperature=0.7, seed=3, logprobs=True,
                            top_logprobs=5, logit_bias={42: 5.0}, presence_penalty=1.0)  # fmt: skip
    run = engine.generate([prompt], params)[0]
    assert len(run.top_logprobs) == len(run.token_ids) == 4
    for i, top in enumerate(run.top_logprobs):
        logits = engine.prompt_logits(prompt + run.token_ids[:i])
        _check_against_logits(top, logits, 5)
        sampled, lp = run.token_ids[i], run.logprobs[i]
        if sampled in top.token_ids:
            assert top.logprobs[top.token_ids.index(sampled)] == pytest.approx(lp, abs=1e-6)


def test_only_the_rows_that_ask_get_alternatives(engine, default_tokenizer):
    prompts = [_prompt(default_tokenizer, q) for q in ("Hi!", "Count to three.", "Why?")]
    asks = [SamplingParams(max_tokens=3, temperature=0, logprobs=True, top_logprobs=20),
            SamplingParams(max_tokens=3, temperature=0, logprobs=True),
            SamplingParams(max_tokens=3, temperature=1.0, seed=1, logprobs=True,
                           top_logprobs=1)]  # fmt: skip
    runs = engine.generate(prompts, asks)
    assert [len(t.token_ids) for t in runs[0].top_logprobs] == [20, 20, 20]
    assert runs[1].top_logprobs == []
    assert [len(t.token_ids) for t in runs[2].top_logprobs] == [1, 1, 1]
    # greedy: the sampled token is the most likely one, with the same logprob
    for top, tok, lp in zip(runs[0].top_logprobs, runs[0].token_ids, runs[0].logprobs,
                            strict=True):  # fmt: skip
        assert top.token_ids[0] == tok and top.logprobs[0] == lp
    _check_against_logits(runs[0].top_logprobs[0], engine.prompt_logits(prompts[0]), 20)


def test_bad_top_logprobs_are_refused_by_name() -> None:
    for kwargs in ({"top_logprobs": 21, "logprobs": True}, {"top_logprobs": -1},
                   {"top_logprobs": 2}, {"top_logprobs": True, "logprobs": True}):  # fmt: skip
        with pytest.raises(InvalidRequestError, match="top_logprobs"):
            SamplingParams(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="include_stop_str_in_output"):
        SamplingParams(include_stop_str_in_output=1)  # type: ignore[arg-type]


def test_the_stop_checker_can_keep_the_stop_string() -> None:
    assert StopChecker(["STOP"], include_stop=True).feed("abSTOPcd") == ("abSTOP", True)
    checker = StopChecker(["abcd", "c"], include_stop=True)
    assert checker.feed("xab") == ("x", False)  # "ab" held: it may start "abcd"
    assert checker.feed("cd") == ("abc", True)  # "c" completes first


def _stream(engine: LLMEngine, prompt, params, resumed=()) -> tuple[list, list[str]]:
    """Every event of one request: its token events and its text deltas."""
    rid = engine.add_request(prompt, params, resumed=resumed)
    events = []
    while engine.has_unfinished():
        for ev in engine.step():
            assert ev.request_id == rid
            events.append(ev)
    return events, [ev.text_delta for ev in events]


@pytest.mark.parametrize("include", [True, False], ids=["kept", "cut"])
def test_a_resumed_stream_continues_with_the_same_text_and_alternatives(
    engine, other, default_tokenizer, include
) -> None:
    tok = default_tokenizer
    prompt = _prompt(tok, "Tell me a story about a lighthouse keeper.")
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    base = engine.generate([prompt], plain)[0]
    # a stop string over two tokens' boundary, so the first one's text is held back
    stop = tok.decode(base.token_ids[8:10])
    assert len(tok.decode(base.token_ids[8:9])) < len(stop)
    params = dataclasses.replace(plain, stop=(stop,), include_stop_str_in_output=include,
                                 logprobs=True, top_logprobs=3)  # fmt: skip
    events, deltas = _stream(engine, prompt, params)
    at = base.text.find(stop)
    full = "".join(deltas)
    assert full == base.text[: at + len(stop) if include else at]
    assert events[-1].finish_reason == "stop"
    tokens = [t for ev in events for t in ev.new_token_ids]
    tops = [t for ev in events for t in ev.new_top_logprobs]
    held = []
    for cut in range(len(tokens) - 3, len(tokens)):
        got_events, got = _stream(other, prompt, params, resumed=tokens[:cut])
        assert "".join(deltas[:cut]) + "".join(got) == full, f"cut at {cut}"
        assert [t for ev in got_events for t in ev.new_token_ids] == tokens[cut:]
        assert [t for ev in got_events for t in ev.new_top_logprobs] == tops[cut:]
        held.append(len(tok.decode(tokens[:cut])) > len("".join(deltas[:cut])))
    assert any(held)  # some cut fell where the client had not seen all the text yet

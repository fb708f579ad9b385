"""A migrated request resumes where its previous worker stopped: same tokens, same text.

``resumed`` output tokens are context computed after the prompt; generation continues after
them, with the detokenizer, the stop-string checker, max_tokens and a seeded random stream
exactly where an uninterrupted run would have them.
"""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.engine.test_disagg_roles import _copy_layer

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt(default_tokenizer) -> list[int]:
    text = default_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a short poem about the sea."}]
    )
    return default_tokenizer.encode(text)


@pytest.fixture(scope="module")
def engine(make_engine) -> LLMEngine:
    return make_engine(num_kv_blocks=64)


def _run(engine: LLMEngine, rid: str) -> tuple[list[int], list[str]]:
    tokens: list[int] = []
    deltas: list[str] = []
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.request_id == rid:
                tokens.extend(ev.new_token_ids)
                deltas.append(ev.text_delta)
    return tokens, deltas


def _uninterrupted(engine: LLMEngine, prompt, params) -> tuple[list[int], list[str]]:
    rid = engine.add_request(prompt, params)
    return _run(engine, rid)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_colocated_resume_continues_the_same_tokens_and_text(engine, prompt, params) -> None:
    full, deltas = _uninterrupted(engine, prompt, params)
    assert len(full) == params.max_tokens
    for k in (1, params.max_tokens - 1):
        rid = engine.add_request(prompt, params, f"resume-{k}", resumed=full[:k])
        rest, rest_deltas = _run(engine, rid)
        assert rest == full[k:], f"cut at {k}"
        assert "".join(deltas[:k]) + "".join(rest_deltas) == "".join(deltas), f"cut at {k}"


def test_disaggregated_resume_equals_uninterrupted(make_engine, engine, prompt) -> None:
    """Prompt + resumed tokens prefilled on one engine (first token drawn there, at output
    position k), the KV moved, decoding continued on another."""
    reference = engine
    prefill = make_engine(num_kv_blocks=64)
    decode = make_engine(num_kv_blocks=200)
    decode.blocks.allocate(5)  # block ids differ between the two sides
    for params in (GREEDY, SEEDED):
        full, _ = _uninterrupted(reference, prompt, params)
        k = 7
        rid = f"m-{params.seed}"
        res = decode.reserve(rid, prompt, params, resumed=full[:k])
        admitted = prefill.admit_prompt(rid, prompt, params, resumed=full[:k])
        assert admitted.num_tokens == len(prompt) + k
        assert len(res.block_ids) == len(admitted.block_ids)
        skip = res.num_present_tokens // decode.config.block_size
        src, dst = admitted.block_ids[skip:], res.block_ids[skip:]

        def copy(layer: int, src=src, dst=dst) -> None:
            _copy_layer(prefill.kv, decode.kv, layer, src, dst)

        (out,) = prefill.run_prefill([admitted], copy)
        prefill.release(rid)
        first = decode.add_prefilled(rid, out.token_id, out.logprob)
        assert first.num_output_tokens == k + 1
        rest, _ = _run(decode, rid)
        assert [out.token_id, *rest] == full[k:]


def test_resume_that_already_ended_is_refused(engine, prompt, default_tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        engine.add_request(prompt, GREEDY, "a", resumed=[1] * GREEDY.max_tokens)
    eos = next(iter(default_tokenizer.eos_token_ids))
    stops_at_eos = SamplingParams(max_tokens=8, temperature=0.0)
    with pytest.raises(InvalidRequestError, match=r"resume_token_ids\[1\] already ended"):
        engine.reserve("b", prompt, stops_at_eos, resumed=[42, eos])
    with pytest.raises(InvalidRequestError, match="token ids must be integers"):
        engine.admit_prompt("c", prompt, GREEDY, resumed=[10**9])
    assert engine.num_held == 0 and not engine.has_unfinished()


def test_fence_frees_the_id_and_keeps_the_blocks(engine, prompt) -> None:
    free = engine.blocks.num_free_blocks
    first = engine.reserve("r", prompt, GREEDY)
    key = engine.fence("r", "attempt-0")
    second = engine.reserve("r", prompt, GREEDY)  # the id is free again ...
    # ... and the blocks a writer may still fill are not reused: only cached blocks (never
    # written by a prefill) are shared
    k = first.num_present_tokens // engine.config.block_size
    assert not set(first.block_ids[k:]) & set(second.block_ids)
    held = set(first.block_ids) | set(second.block_ids)
    assert engine.blocks.num_free_blocks == free - len(held)
    assert engine.release(key) and engine.release("r")
    assert engine.blocks.num_free_blocks == free
    engine.blocks.check_invariants()

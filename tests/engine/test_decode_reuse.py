"""A decode reservation reuses the decode pool's own cached blocks.

A finished request leaves its full blocks (prompt and generated output) in the prefix
cache; a later request starting with the same tokens (the next turn of a conversation, a
migrated request) gets them back from ``reserve`` as ``num_present_tokens``, and only the
other blocks are filled by the prefill worker. Every holder references a block once, and
every way out (add_prefilled then finish, release, fence, cancel, abort, a failed reserve)
drops exactly that reference.
"""

from __future__ import annotations

import pytest

from engine.block_hash import hash_blocks
from engine.errors import ResourceExhaustedError
from engine.llm_engine import LLMEngine, PrefillOutput, Reservation
from engine.sampling_params import SamplingParams
from tests.engine.parity import assert_greedy_equal
from tests.engine.test_disagg_roles import _copy_layer

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
BS = 16


@pytest.fixture(scope="module")
def turn1(default_tokenizer) -> list[int]:
    tok = default_tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": "Describe the moon."}]))


@pytest.fixture(scope="module")
def follow_up(default_tokenizer) -> list[int]:
    return default_tokenizer.encode("\nAnd how far away is it from the Earth?")


def _prefill_into(
    prefill: LLMEngine, decode: LLMEngine, rid: str, ids: list[int], resumed: list[int] = ()
) -> tuple[Reservation, PrefillOutput]:
    """Reserve on ``decode``, compute on ``prefill``, copy only the blocks ``decode`` lacks."""
    res = decode.reserve(rid, ids, GREEDY, resumed)
    admitted = prefill.admit_prompt(rid, ids, GREEDY, resumed)
    k = res.num_present_tokens // BS

    def copy(layer: int) -> None:
        _copy_layer(prefill.kv, decode.kv, layer, admitted.block_ids[k:], res.block_ids[k:])

    (out,) = prefill.run_prefill([admitted], copy)
    assert prefill.release(rid)
    return res, out


def _run(decode: LLMEngine, rid: str, first: list[int]) -> list[int]:
    toks = list(first)
    while decode.has_unfinished():
        toks += [t for ev in decode.step() if ev.request_id == rid for t in ev.new_token_ids]
    return toks


def _owned(engine: LLMEngine, block_ids) -> list[int]:
    return [engine.blocks.ref_count(b) for b in block_ids]


def test_a_later_turn_reuses_the_earlier_turns_prompt_and_output_blocks(
    make_engine, turn1, follow_up
) -> None:
    prefill, decode = make_engine(num_kv_blocks=64), make_engine(num_kv_blocks=64)
    decode.blocks.allocate(3)  # block ids differ between the two sides
    res1, out1 = _prefill_into(prefill, decode, "t1", turn1)
    assert res1.num_present_tokens == 0
    ev = decode.add_prefilled("t1", out1.token_id, out1.logprob)
    toks1 = _run(decode, "t1", list(ev.new_token_ids))

    turn2 = turn1 + toks1 + follow_up
    # turn 1's last token was sampled, never computed: its KV is not in the cache
    computed = len(turn1) + len(toks1) - 1
    res2, out2 = _prefill_into(prefill, decode, "t2", turn2)
    assert res2.num_present_tokens == computed // BS * BS
    assert res2.num_present_tokens > len(turn1)  # blocks of turn 1's output reused too
    k = res2.num_present_tokens // BS
    hashes = hash_blocks(turn2, BS)
    assert [decode.blocks.block_hash_of(b) for b in res2.block_ids[:k]] == hashes[:k]
    assert _owned(decode, res2.block_ids) == [1] * len(res2.block_ids)
    # the prefill worker computed what its own cache lacked: turn 1's prompt was there
    assert out2.num_cached_tokens == len(turn1) // BS * BS

    ev = decode.add_prefilled("t2", out2.token_id, out2.logprob, num_cached_tokens=17)
    assert ev.num_cached_tokens == 17  # usage: what this request did not compute
    # the prompt's full blocks are published under their chained hashes, hit part included
    full = len(turn2) // BS
    assert [decode.blocks.block_hash_of(b) for b in res2.block_ids[:full]] == hashes[:full]
    toks2 = _run(decode, "t2", list(ev.new_token_ids))

    reference = make_engine()
    assert toks1 == reference.generate([turn1], GREEDY)[0].token_ids
    # turn 1's output KV was computed a row at a time, the reference's in one pass
    assert_greedy_equal(
        reference, [turn2], [toks2], [reference.generate([turn2], GREEDY)[0].token_ids]
    )
    decode.blocks.check_invariants()
    assert decode.num_held == 0 and decode.blocks.num_free_blocks == 64 - 3


def test_reused_blocks_are_referenced_once_per_holder_and_freed_exactly_once(
    make_engine, turn1, follow_up
) -> None:
    decode = make_engine(num_kv_blocks=64)
    toks = decode.generate([turn1], GREEDY)[0].token_ids  # colocated: its blocks cached too
    turn2 = turn1 + toks + follow_up
    a = decode.reserve("a", turn2, GREEDY)
    b = decode.reserve("b", turn2, GREEDY)
    k = a.num_present_tokens // BS
    assert k > 0 and b.num_present_tokens == a.num_present_tokens
    assert a.block_ids[:k] == b.block_ids[:k]
    assert not set(a.block_ids[k:]) & set(b.block_ids[k:])
    assert _owned(decode, a.block_ids) == [2] * k + [1] * (len(a.block_ids) - k)
    decode.blocks.check_invariants()

    key = decode.fence("a", "attempt-0")
    c = decode.reserve("a", turn2, GREEDY)  # the id is free again; the hit shared thrice
    assert c.block_ids[:k] == a.block_ids[:k]
    assert _owned(decode, a.block_ids[:k]) == [3] * k
    assert decode.release(key)
    assert _owned(decode, a.block_ids) == [2] * k + [0] * (len(a.block_ids) - k)
    assert decode.release("b")
    assert _owned(decode, a.block_ids[:k]) == [1] * k
    assert decode.abort_request("a")
    assert _owned(decode, a.block_ids[:k]) == [0] * k
    assert not decode.release("a") and not decode.release(key)  # no second free
    decode.blocks.check_invariants()
    assert decode.num_held == 0 and decode.blocks.num_free_blocks == 64

    # freed, the blocks stay cached: the same prefix is found again
    d = decode.reserve("d", turn2, GREEDY)
    assert d.block_ids[:k] == a.block_ids[:k] and d.num_present_tokens == a.num_present_tokens
    assert decode.release("d")
    decode.blocks.check_invariants()


def test_a_reserve_that_fails_gives_the_hit_back(make_engine, turn1, follow_up) -> None:
    decode = make_engine(num_kv_blocks=16)
    toks = decode.generate([turn1], GREEDY)[0].token_ids
    turn2 = turn1 + toks + follow_up
    cached = (len(turn1) + len(toks) - 1) // BS
    # Take every free block but the cached ones (unhashed blocks are allocated first):
    # the hit alone is left, and the rest of turn 2 finds no room.
    hold = decode.blocks.allocate(decode.blocks.num_free_blocks - cached)
    hit = [b for b in range(16) if decode.blocks.block_hash_of(b) is not None]
    assert len(hit) == cached and not set(hit) & set(hold)
    with pytest.raises(ResourceExhaustedError):
        decode.reserve("r", turn2, GREEDY)
    assert _owned(decode, hit) == [0] * cached  # references dropped, hashes kept
    assert all(decode.blocks.block_hash_of(b) is not None for b in hit)
    assert decode.num_held == 0
    decode.blocks.check_invariants()
    decode.blocks.free(hold)
    res = decode.reserve("r", turn2, GREEDY)  # the id was not taken by the failed attempt
    assert res.num_present_tokens == cached * BS
    assert decode.release("r")
    assert decode.blocks.num_free_blocks == 16
    decode.blocks.check_invariants()


def test_a_migrated_request_reuses_its_own_cached_output(make_engine, turn1) -> None:
    """A resumed request (prompt + output so far) matches cached blocks across both."""
    prefill, decode = make_engine(num_kv_blocks=64), make_engine(num_kv_blocks=64)
    full = decode.generate([turn1], GREEDY)[0].token_ids
    k = 20
    res, out = _prefill_into(prefill, decode, "m", turn1, full[:k])
    assert res.num_present_tokens == (len(turn1) + k - 1) // BS * BS
    assert res.num_present_tokens > len(turn1)
    assert len(res.block_ids) == -(-(len(turn1) + k) // BS)
    ev = decode.add_prefilled("m", out.token_id, out.logprob)
    assert ev.num_output_tokens == k + 1
    rest = _run(decode, "m", list(ev.new_token_ids))
    assert_greedy_equal(decode, [turn1 + full[:k]], [rest], [full[k:]])  # rows recomputed at once
    decode.blocks.check_invariants()
    assert decode.blocks.num_free_blocks == 64


def test_a_hit_never_covers_the_last_token(make_engine, turn1) -> None:
    decode = make_engine(num_kv_blocks=64)
    toks = decode.generate([turn1], GREEDY)[0].token_ids
    ids = (turn1 + toks)[: 2 * BS]  # two full blocks, both cached
    cached = [decode.blocks.block_hash_of(b) for b in range(64)]
    first, second = hash_blocks(ids, BS)
    assert first in cached and second in cached
    res = decode.reserve("r", ids, GREEDY)
    # the last token is computed (its logits give the first token): its block is fresh
    assert res.num_present_tokens == BS
    assert decode.blocks.block_hash_of(res.block_ids[0]) == first
    assert decode.blocks.block_hash_of(res.block_ids[1]) is None
    assert decode.release("r")
    res = decode.reserve("r", [*ids, ids[0]], GREEDY)  # one more token: both blocks present
    assert res.num_present_tokens == 2 * BS
    assert decode.release("r")
    decode.blocks.check_invariants()

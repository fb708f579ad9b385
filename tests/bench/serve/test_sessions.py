"""Conversation workloads on the real default tokenizer: what is shared is shared whole (the
system prompt, across the sessions of a run), what is not is not (each session's messages,
and anything of another run), and turn k sends the whole conversation before it."""

from __future__ import annotations

import random

import pytest

from bench.serve.prompts import NONCE_WORDS
from bench.serve.sessions import (
    TAG_FIRST_TURN,
    TAG_LATER_TURN,
    Session,
    build_long_document,
    build_multi_turn,
    build_shared_prefix,
    turn_request,
)
from bench.serve.workload import TAG_REQUEST, ChatMessage, RequestSpec
from engine.tokenizer import Tokenizer

BLOCK = 16  # the stack's KV block size: a shared cached block is a shared run of 16 tokens


def multi(tokenizer: Tokenizer, **kw: object) -> list[Session]:
    args: dict[str, object] = dict(sessions=3, turns=3, system_tokens=40, user_tokens=12,
                                   output_tokens=5, seed=1)  # fmt: skip
    return build_multi_turn(tokenizer, **{**args, **kw})  # type: ignore[arg-type]


def ids(tokenizer: Tokenizer, spec: RequestSpec) -> list[int]:
    """The prompt a server builds from ``spec``'s messages."""
    messages = [{"role": m.role, "content": m.content} for m in spec.messages]
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_sessions_of_a_run_share_the_system_prompt_and_nothing_after_it(
    tokenizer: Tokenizer,
) -> None:
    sessions = multi(tokenizer)
    assert len({s.system for s in sessions}) == 1
    system_ids = tokenizer.encode(sessions[0].system, add_special_tokens=False)
    assert len(system_ids) == 40  # one token a word
    first = [ids(tokenizer, turn_request(s, 0, [])) for s in sessions]
    shared = common_prefix(first[0], first[1])
    # the whole system message is shared, and the users' nonces differ at once after it
    assert first[0][:shared] == first[2][:shared]
    head = first[0][:shared]
    assert any(head[i : i + 40] == system_ids for i in range(shared - 39))
    assert shared <= 40 + 10  # the template's few tokens, then the user's nonce
    firsts = [s.user_turns[0] for s in sessions]
    nonce_ids = [tokenizer.encode(t, add_special_tokens=False)[:NONCE_WORDS] for t in firsts]
    assert len({tuple(n) for n in nonce_ids}) == 3
    assert all(len(tokenizer.encode(t, add_special_tokens=False)) == 12 for t in firsts)


def test_two_runs_share_no_block(tokenizer: Tokenizer) -> None:
    a, b = multi(tokenizer)[0], multi(tokenizer)[0]  # same seed, fresh nonces
    assert a.system != b.system
    pa, pb = ids(tokenizer, turn_request(a, 0, [])), ids(tokenizer, turn_request(b, 0, []))
    assert common_prefix(pa, pb) < BLOCK
    # the seed fixes everything but the nonces
    fixed = [multi(tokenizer, nonce_rng=random.Random(7))[0] for _ in range(2)]
    assert fixed[0] == fixed[1]
    assert a.system.split()[NONCE_WORDS:] == b.system.split()[NONCE_WORDS:]


def test_turn_k_sends_the_whole_conversation_before_it(tokenizer: Tokenizer) -> None:
    s = multi(tokenizer)[1]
    answers = ["Sure thing.", " Another answer"]
    spec = turn_request(s, 2, answers)
    assert spec.messages == (
        ChatMessage("system", s.system),
        ChatMessage("user", s.user_turns[0]), ChatMessage("assistant", answers[0]),
        ChatMessage("user", s.user_turns[1]), ChatMessage("assistant", answers[1]),
        ChatMessage("user", s.user_turns[2]),
    )  # fmt: skip
    assert (spec.session, spec.turn, spec.output_tokens, spec.tag) == (1, 2, 5, TAG_LATER_TURN)
    assert turn_request(s, 0, []).tag == TAG_FIRST_TURN
    # the turn before is a prefix of this one, its answer included
    before = ids(tokenizer, turn_request(s, 1, answers[:1]))
    now = ids(tokenizer, spec)
    assert common_prefix(before, now) >= len(before) - 3  # all but the generation prompt
    assert s.user_turns[1].split()[:NONCE_WORDS] != s.user_turns[0].split()[:NONCE_WORDS]
    with pytest.raises(ValueError, match="needs the 2 answers"):
        turn_request(s, 2, answers[:1])
    with pytest.raises(ValueError):
        turn_request(s, 3, [*answers, "x"])


def test_shared_prefix_users_share_only_their_system_prompt(tokenizer: Tokenizer) -> None:
    users = build_shared_prefix(tokenizer, system_prompts=3, users=7, system_tokens=40,
                                user_tokens=10, output_tokens=4, seed=2)  # fmt: skip
    assert [u.system_index for u in users] == [0, 1, 2, 0, 1, 2, 0]
    assert len({u.system for u in users}) == 3
    assert all(u.turns == 1 and u.system == users[u.system_index].system for u in users)
    prompts = [ids(tokenizer, turn_request(u, 0, [])) for u in users]
    assert all(turn_request(u, 0, []).tag == TAG_REQUEST for u in users)
    same, other = common_prefix(prompts[0], prompts[3]), common_prefix(prompts[0], prompts[1])
    assert same >= 40 and other < BLOCK
    assert len({tuple(p[same:]) for p in prompts}) == 7
    again = build_shared_prefix(tokenizer, system_prompts=3, users=1, system_tokens=40,
                                user_tokens=10, output_tokens=4, seed=2)  # fmt: skip
    assert common_prefix(prompts[0], ids(tokenizer, turn_request(again[0], 0, []))) < BLOCK


def test_sizes_must_be_positive(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="turns"):
        multi(tokenizer, turns=0)
    with pytest.raises(ValueError, match="system_prompts"):
        build_shared_prefix(tokenizer, system_prompts=0, users=1, system_tokens=1,
                            user_tokens=1, output_tokens=1)  # fmt: skip


def test_long_document_sessions_each_have_a_document_of_their_own(tokenizer: Tokenizer) -> None:
    shape = dict(sessions=3, turns=2, min_doc_tokens=60, max_doc_tokens=90, user_tokens=8,
                 output_tokens=4, seed=2)  # fmt: skip
    built = build_long_document(tokenizer, **shape)  # type: ignore[arg-type]
    assert [s.turns for s in built] == [2, 2, 2]
    docs = [ids(tokenizer, turn_request(s, 0, [])) for s in built]
    for i, a in enumerate(docs):  # each opens with its own nonce: no shared block
        assert all(common_prefix(a, b) < BLOCK for b in docs[i + 1 :])
    for s in built:
        assert 60 <= len(tokenizer.encode(s.system, add_special_tokens=False)) <= 90 + 2
    again = build_long_document(tokenizer, **shape)  # type: ignore[arg-type]
    # the same seed draws the same lengths and questions, fresh nonces
    assert [len(s.system.split()) for s in again] == [len(s.system.split()) for s in built]
    assert [s.user_turns for s in again] == [s.user_turns for s in built]
    with pytest.raises(ValueError, match="max_doc_tokens"):
        build_long_document(tokenizer, sessions=1, turns=1, min_doc_tokens=9, max_doc_tokens=8,
                            user_tokens=1, output_tokens=1)  # fmt: skip

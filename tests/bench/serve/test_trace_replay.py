"""Replaying a trace: scaling, seeded sampling of whole conversations, caps, and prompts
that share exactly the prefixes the trace's hash ids say (on the real default tokenizer)."""

from __future__ import annotations

import pytest

from bench.serve.prompts import bos_prefix
from bench.serve.trace import TraceRequest
from bench.serve.trace_replay import ReplayOptions, build_trace, select
from engine.tokenizer import Tokenizer


def req(
    ts_ms: float, ids: tuple[int, ...], input_length: int = 512, output: int = 64
) -> TraceRequest:
    return TraceRequest(ts_ms, input_length, output, ids)


def test_options_are_checked() -> None:
    assert ReplayOptions().block_tokens == 32 and ReplayOptions(token_divisor=1).block_tokens == 512
    bad_options = ({"token_divisor": 3}, {"token_divisor": 0}, {"token_divisor": 1024},
                   {"time_scale": 0.0}, {"sample": 0}, {"max_requests": 0},
                   {"duration_s": -1.0})  # fmt: skip
    for bad in bad_options:
        with pytest.raises(ValueError):
            ReplayOptions(**bad)  # type: ignore[arg-type]


def test_lengths_are_divided_and_rounded_keeping_one_token() -> None:
    opts = ReplayOptions(token_divisor=16)
    assert [opts.scaled(n) for n in (1000, 1008, 1007, 24, 8, 7, 1, 0)] == [
        63, 63, 63, 2, 1, 1, 1, 1,
    ]  # fmt: skip


def test_gaps_are_scaled_from_the_first_kept_request() -> None:
    trace = [req(5000, (1,)), req(1000, (2,)), req(4000, (3,)), req(3000, (4,))]
    offsets = [s.offset_s for s in select(trace, ReplayOptions(time_scale=1.0))]
    assert offsets == [0.0, 2.0, 3.0, 4.0]  # sorted by timestamp, rebased to the first
    assert [s.request.timestamp_ms for s in select(trace, ReplayOptions())] == [1000, 3000, 4000,
                                                                                5000]  # fmt: skip
    assert [s.offset_s for s in select(trace, ReplayOptions(time_scale=2.5))] == [0, 5, 7.5, 10]
    assert [s.offset_s for s in select(trace, ReplayOptions(time_scale=0.5))] == [0, 1, 1.5, 2]


def test_caps_cut_by_send_time_and_count() -> None:
    trace = [req(1000 * i, (i,)) for i in range(10)]
    assert len(select(trace, ReplayOptions(duration_s=4.0, max_requests=None))) == 4  # 0..3 s
    assert len(select(trace, ReplayOptions(duration_s=4.0, time_scale=0.5))) == 8
    assert len(select(trace, ReplayOptions(duration_s=None, max_requests=3))) == 3
    assert len(select(trace, ReplayOptions(duration_s=None, max_requests=None))) == 10


def test_sampling_keeps_whole_conversations_for_a_seed() -> None:
    # 12 conversations of 3 turns; conversation c's turns share its first id 100 + c
    trace = [req(1000 * (c + 10 * t), (100 + c, 1000 * c + t)) for t in range(3) for c in range(12)]
    trace.append(req(5, ()))  # no ids: a conversation of its own

    def groups(seed: int, n: int) -> list[int | None]:
        kept = select(trace, ReplayOptions(sample=n, seed=seed))
        by_group: dict[int | None, int] = {}
        for s in kept:
            by_group[s.request.group] = by_group.get(s.request.group, 0) + 1
        assert all(count == 3 for g, count in by_group.items() if g is not None)  # whole
        return sorted(by_group, key=str)

    a = groups(seed=1, n=4)
    assert len(a) == 4 and groups(seed=1, n=4) == a  # the same seed keeps the same ones
    assert groups(seed=2, n=4) != a
    assert len(groups(seed=0, n=100)) == 13  # more than there are: all of them


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_prompts_share_exactly_the_leading_run_of_hash_ids(tokenizer: Tokenizer) -> None:
    opts = ReplayOptions(token_divisor=16)  # blocks of 32 tokens
    bos = len(bos_prefix(tokenizer))
    trace = [
        req(0, (1, 2, 3), input_length=1536),
        req(10, (1, 2, 4), input_length=1536),  # shares 2 blocks with the first
        req(20, (1, 5), input_length=1024),  # shares 1 block with both
        req(30, (6, 2, 3), input_length=1536),  # a different first block: shares nothing
        req(40, (1, 2), input_length=800),  # the first's first 50 tokens, block 2 partial
        req(50, (1, 2), input_length=2000),  # past its blocks: 61 words of its own
    ]
    specs, stats = build_trace(tokenizer, trace, opts, nonce="n")
    ids = [s.prompt_ids for s in specs]
    assert [len(p) for p in ids] == [96, 96, 64, 96, 50, 125]
    assert _common_prefix(ids[0], ids[1]) == bos + 64
    assert _common_prefix(ids[0], ids[2]) == bos + 32 == _common_prefix(ids[1], ids[2])
    assert _common_prefix(ids[0], ids[3]) == 0
    assert ids[0][:50] == ids[4] and ids[5][:64] == ids[0][:64]
    assert _common_prefix(ids[4], ids[5]) == 50
    # the second and third blocks are position-free: id 2 after id 6 is id 2's words
    assert ids[3][bos + 32 :] == ids[0][bos + 32 :]
    # text re-encodes to the same ids: --prompt-format text sends the same prompt
    assert tokenizer.encode(specs[1].prompt_text) == list(ids[1])
    # what an earlier request sent: 0, 64, 32, 0 (a different first block), 50, then 64
    assert stats.reusable_tokens == (bos + 64) + (bos + 32) + 50 + (bos + 64)
    assert stats.prompt_tokens == 96 + 96 + 64 + 96 + 50 + 125
    assert [s.tag for s in specs] == ["new-prefix", "seen-prefix", "seen-prefix", "new-prefix",
                                      "seen-prefix", "seen-prefix"]  # fmt: skip
    assert [(s.session, s.turn) for s in specs] == [(0, 0), (0, 1), (0, 2), (1, 0), (0, 3),
                                                    (0, 4)]  # fmt: skip
    assert [s.start_offset_s for s in specs] == [0.0, 0.01, 0.02, 0.03, 0.04, 0.05]
    assert [s.output_tokens for s in specs] == [4] * 6


def test_a_run_nonce_makes_its_own_blocks(tokenizer: Tokenizer) -> None:
    trace = [req(0, (1, 2), input_length=1024), req(1, (3,), input_length=300)]
    same = build_trace(tokenizer, trace, ReplayOptions(), nonce="a")[0]
    assert build_trace(tokenizer, trace, ReplayOptions(), nonce="a")[0] == same
    other = build_trace(tokenizer, trace, ReplayOptions(), nonce="b")[0]
    assert _common_prefix(same[0].prompt_ids, other[0].prompt_ids) == len(bos_prefix(tokenizer))
    fresh = build_trace(tokenizer, trace, ReplayOptions())[0]  # the default: a fresh nonce
    assert fresh[0].prompt_ids != same[0].prompt_ids
    assert len(fresh[1].prompt_ids) == 19  # 300 / 16 = 18.75


def test_the_stats_count_what_is_sent(tokenizer: Tokenizer) -> None:
    trace = [req(1000 * i, (i % 3, 100 + i), input_length=1024, output=160) for i in range(9)]
    specs, stats = build_trace(tokenizer, trace, ReplayOptions(sample=2, seed=4, time_scale=2),
                               nonce="x")  # fmt: skip
    assert (stats.trace_requests, stats.trace_groups, stats.requests, stats.groups) == (9, 3, 6, 2)
    assert stats.prompt_tokens == 6 * 64 and stats.output_tokens == 6 * 10
    assert stats.reusable_tokens == 4 * 32  # the later request of each group: its first block
    assert stats.reusable_share == 128 / 384 and stats.max_prompt_tokens == 64
    assert stats.span_s == specs[-1].start_offset_s and stats.span_s in (14.0, 16.0)
    assert stats.to_dict()["reusable_share"] == stats.reusable_share
    with pytest.raises(ValueError, match="no request"):
        build_trace(tokenizer, [], ReplayOptions(), nonce="x")

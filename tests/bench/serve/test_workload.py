"""Workload builders on the real default tokenizer: exact lengths, fresh nonces, schedules."""

from __future__ import annotations

import random

import pytest

from bench.serve.prompts import NONCE_WORDS, PromptFactory
from bench.serve.workload import (
    LogNormal,
    Uniform,
    build_dist,
    build_fixed,
    build_interference,
)
from engine.tokenizer import Tokenizer


@pytest.mark.parametrize("n", [1, 2, 6, 7, 32, 1024])
def test_prompt_lengths_exact_as_ids_and_as_text(tokenizer: Tokenizer, n: int) -> None:
    p = PromptFactory(tokenizer, seed=1).make(n)
    assert len(p.ids) == n
    assert tokenizer.encode(p.text) == list(p.ids)  # what a server tokenizing the text gets


@pytest.mark.parametrize("n", [31, 64, 500])
def test_chat_prompt_length_counts_the_template(tokenizer: Tokenizer, n: int) -> None:
    factory = PromptFactory(tokenizer, seed=1, chat=True)
    p = factory.make(n)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": p.text}])
    assert tokenizer.encode(rendered, add_special_tokens=False) == list(p.ids)
    assert len(p.ids) == n
    with pytest.raises(ValueError):
        factory.make(factory.min_tokens - 1)


def test_nonces_are_fresh_and_filler_is_seeded(tokenizer: Tokenizer) -> None:
    a = PromptFactory(tokenizer, seed=5).make(64)
    b = PromptFactory(tokenizer, seed=5).make(64)
    assert a.ids[:NONCE_WORDS] != b.ids[:NONCE_WORDS]
    assert a.ids[NONCE_WORDS:] == b.ids[NONCE_WORDS:]
    c = PromptFactory(tokenizer, seed=6).make(64)
    assert c.ids[NONCE_WORDS:] != a.ids[NONCE_WORDS:]
    # the nonce generator is the only other source of randomness
    x = PromptFactory(tokenizer, seed=5, nonce_rng=random.Random(0)).make(64)
    y = PromptFactory(tokenizer, seed=5, nonce_rng=random.Random(0)).make(64)
    assert x == y
    with pytest.raises(ValueError):
        PromptFactory(tokenizer).make(0)


def test_build_fixed(tokenizer: Tokenizer) -> None:
    specs = build_fixed(tokenizer, num_requests=5, prompt_tokens=40, output_tokens=7, seed=2)
    assert len(specs) == 5
    assert all(s.prompt_tokens == 40 and s.output_tokens == 7 for s in specs)
    assert all(s.tag == "request" and s.start_offset_s is None for s in specs)
    assert len({s.prompt_ids[:NONCE_WORDS] for s in specs}) == 5
    chat = build_fixed(tokenizer, num_requests=1, prompt_tokens=40, output_tokens=7, chat=True)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": chat[0].prompt_text}])
    assert len(tokenizer.encode(rendered, add_special_tokens=False)) == 40


def test_build_dist_bounds_and_seeding(tokenizer: Tokenizer) -> None:
    kw = {"num_requests": 40, "prompt_dist": Uniform(10, 50), "output_dist": Uniform(3, 9)}
    specs = build_dist(tokenizer, seed=3, **kw)
    assert all(10 <= s.prompt_tokens <= 50 and 3 <= s.output_tokens <= 9 for s in specs)
    assert len({s.prompt_tokens for s in specs}) > 1
    again = build_dist(tokenizer, seed=3, **kw)
    lengths = [(s.prompt_tokens, s.output_tokens) for s in specs]
    assert [(s.prompt_tokens, s.output_tokens) for s in again] == lengths
    other = build_dist(tokenizer, seed=4, **kw)
    assert [(s.prompt_tokens, s.output_tokens) for s in other] != lengths
    logn = build_dist(tokenizer, num_requests=200, prompt_dist=LogNormal(100, 0.5, 20, 400),
                      output_dist=LogNormal(10, 1.5, 1, 20), seed=0)  # fmt: skip
    prompts = sorted(s.prompt_tokens for s in logn)
    assert all(20 <= p <= 400 for p in prompts)
    assert 60 < prompts[100] < 160  # median of lognormal(ln 100, 0.5) over 200 draws
    assert {s.output_tokens for s in logn} >= {1, 20}  # sigma 1.5 reaches both clips
    with pytest.raises(ValueError):
        build_dist(tokenizer, num_requests=1, prompt_dist=Uniform(0, 5), output_dist=Uniform(1, 2))


def test_build_interference_schedule(tokenizer: Tokenizer) -> None:
    specs = build_interference(
        tokenizer, streams=3, stream_prompt_tokens=32, stream_output_tokens=64,
        long_prompt_tokens=300, long_output_tokens=4, long_start_s=1.5, long_every_s=2.0,
        long_count=2, seed=0, stream_stagger_s=0.25,
    )  # fmt: skip
    assert [(s.tag, s.start_offset_s) for s in specs] == [
        ("stream", 0.0), ("stream", 0.25), ("stream", 0.5), ("long", 1.5), ("long", 3.5),
    ]  # fmt: skip
    streams = [s for s in specs if s.tag == "stream"]
    longs = [s for s in specs if s.tag == "long"]
    assert all(s.prompt_tokens == 32 and s.output_tokens == 64 for s in streams)
    assert all(s.prompt_tokens == 300 and s.output_tokens == 4 for s in longs)
    assert all(s.while_tag is None for s in specs)
    assert len({s.prompt_ids[:NONCE_WORDS] for s in specs}) == 5


def test_build_interference_defaults_run_until_the_streams_finish(tokenizer: Tokenizer) -> None:
    specs = build_interference(tokenizer, horizon_s=40.0)
    streams = [s for s in specs if s.tag == "stream"]
    longs = [s for s in specs if s.tag == "long"]
    assert len(streams) == 8
    assert all(s.prompt_tokens == 32 and s.output_tokens == 256 for s in streams)
    assert [s.start_offset_s for s in streams] == pytest.approx([i * 0.01 for i in range(8)])
    # first at 2 s, then every 4 s up to the 40 s horizon: 2, 6, ..., 38
    assert [s.start_offset_s for s in longs] == pytest.approx([2.0 + 4 * k for k in range(10)])
    assert all(s.prompt_tokens == 1024 and s.output_tokens == 16 for s in longs)
    assert all(s.while_tag == "stream" for s in longs)
    with pytest.raises(ValueError):
        build_interference(tokenizer, long_every_s=0.0)
    assert [s.tag for s in build_interference(tokenizer, streams=2, long_count=0)] == [
        "stream", "stream",
    ]  # fmt: skip

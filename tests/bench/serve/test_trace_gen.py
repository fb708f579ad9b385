"""The trace generator: deterministic for a seed, Mooncake's format, multi-turn conversations
whose later turns extend the earlier turns' hash ids, and system prompts shared across them."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from pathlib import Path

import pytest

from bench.serve.trace import BLOCK_TOKENS, TraceRequest, read_trace
from bench.serve.trace_gen import TraceShape, generate, main


def _extends(later: TraceRequest, earlier: TraceRequest) -> bool:
    n = len(earlier.hash_ids)
    return len(later.hash_ids) >= n and later.hash_ids[:n] == earlier.hash_ids


def test_the_same_seed_writes_the_same_trace(tmp_path: Path) -> None:
    shape = TraceShape(conversations=12, seed=3)
    assert generate(shape) == generate(shape)
    assert generate(replace(shape, seed=4)) != generate(shape)
    assert main(["--out", str(tmp_path / "a.jsonl"), "--conversations", "12", "--seed", "3"]) == 0
    assert main(["--out", str(tmp_path / "b.jsonl"), "--conversations", "12", "--seed", "3"]) == 0
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert read_trace(tmp_path / "a.jsonl") == generate(shape)  # it parses back whole


def test_a_trace_has_the_asked_shape() -> None:
    shape = TraceShape(conversations=40, turns=(3, 5), rate=0.5, system_prompts=2,
                       system_blocks=2, shared_fraction=0.5, seed=1)  # fmt: skip
    trace = generate(shape)
    times = [r.timestamp_ms for r in trace]
    assert times[0] == 0 and times == sorted(times)
    assert all(len(r.hash_ids) == math.ceil(r.input_length / BLOCK_TOKENS) for r in trace)
    assert all(1 <= r.input_length <= shape.max_input_tokens and r.output_length >= 1
               for r in trace)  # fmt: skip
    # conversations: by first id, except those over a shared system prompt (ids 0..3)
    own = {r.group for r in trace if r.group is not None and r.group >= 4}
    assert 10 < len(own) < 30  # about half of 40 open with blocks of their own
    for group in own:
        turns = [r for r in trace if r.group == group]
        assert 3 <= len(turns) <= 5
        for earlier, later in itertools.pairwise(turns):
            # the next prompt: the last one, its answer and a new message
            assert _extends(later, earlier)
            assert later.input_length > earlier.input_length + earlier.output_length
    # conversations over one system prompt share its two blocks and nothing more
    over_system = [r for r in trace if r.hash_ids[:2] == (0, 1)]
    assert len({r.hash_ids[2] for r in over_system}) > 1
    assert {r.group for r in trace} - own <= {0, 2}


def test_every_conversation_ends_before_its_prompt_passes_the_cap() -> None:
    trace = generate(TraceShape(conversations=30, turns=(8, 8), max_input_tokens=3000,
                                shared_fraction=0.0, seed=2))  # fmt: skip
    assert all(r.input_length <= 3000 for r in trace)
    turns = [sum(r.group == g for r in trace) for g in {r.group for r in trace}]
    assert min(turns) < 8 and max(turns) <= 8


def test_bad_shapes_are_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for bad in ({"turns": (3, 2)}, {"shared_fraction": 1.5}, {"rate": 0.0},
                {"max_input_tokens": 1024}):  # fmt: skip
        with pytest.raises(ValueError):
            TraceShape(**bad)  # type: ignore[arg-type]
    assert main(["--out", str(tmp_path / "x.jsonl"), "--turns", "0", "2"]) == 2
    assert "turns" in capsys.readouterr().err and not (tmp_path / "x.jsonl").exists()

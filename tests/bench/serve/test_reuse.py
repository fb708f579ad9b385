"""Prefix reuse from records (pure): cached vs computed tokens, KV bytes per request, per
worker (the one that computed the prompt), and the tables."""

from __future__ import annotations

from dataclasses import replace

from bench.serve.result import BenchResult, RequestRecord
from bench.serve.reuse import reuse_table, summarize_reuse, summarize_reuse_by_tag, worker_table

BASE = RequestRecord(
    index=0, tag="first-turn", send_s=0.0, end_s=1.0, token_times_s=(0.5,), prompt_tokens=100,
    completion_tokens=1, output_tokens_asked=1, status=200,
)  # fmt: skip


def rec(**kw: object) -> RequestRecord:
    return replace(BASE, **kw)  # type: ignore[arg-type]


RESULT = BenchResult(
    records=(
        rec(cached_tokens=0, kv_transfer_bytes=4000, prefill_worker_id="prefill-0",
            decode_worker_id="decode-0"),
        rec(tag="later-turn", prompt_tokens=200, cached_tokens=150, kv_transfer_bytes=1000,
            prefill_worker_id="prefill-1", decode_worker_id="decode-0"),
        # prefilled on its decode worker: nothing moved
        rec(tag="later-turn", prompt_tokens=300, cached_tokens=290, kv_transfer_bytes=0,
            prefill_worker_id="", decode_worker_id="decode-1"),
        rec(tag="later-turn", error="boom", cached_tokens=100, kv_transfer_bytes=9),  # failed
        rec(tag="later-turn", prompt_tokens=50),  # the server said nothing (not pdserve)
    ),
    duration_s=1.0,
)  # fmt: skip


def test_tokens_and_bytes_add_up_per_tag_and_per_worker() -> None:
    s = summarize_reuse(RESULT)
    t = s.total
    assert (t.requests, t.prompt_tokens, t.cached_tokens, t.computed_tokens) == (3, 600, 440, 160)
    assert t.hit_rate == 440 / 600 and s.unreported == 1
    assert (s.kv_bytes.count, s.kv_bytes.p50, s.kv_bytes.max) == (3, 1000.0, 4000.0)
    assert list(s.workers) == ["decode-1", "prefill-0", "prefill-1"]
    assert s.workers["decode-1"].hit_rate == 290 / 300
    assert s.workers["prefill-0"].kv_transfer_bytes == 4000
    later = summarize_reuse(RESULT, "later-turn")
    assert (later.total.requests, later.total.cached_tokens) == (2, 440)
    assert set(summarize_reuse_by_tag(RESULT)) == {"all", "first-turn", "later-turn"}
    d = s.to_dict()
    assert d["total"]["computed_tokens"] == 160 and d["workers"]["prefill-1"]["hit_rate"] == 0.75


def test_unknown_workers_and_empty_runs() -> None:
    bare = BenchResult((rec(cached_tokens=10),), 1.0)
    assert list(summarize_reuse(bare).workers) == ["?"]
    empty = summarize_reuse(BenchResult((), 0.0))
    assert empty.total.hit_rate is None and empty.kv_bytes.p50 is None


def test_tables() -> None:
    by_tag = summarize_reuse_by_tag(RESULT)
    table = reuse_table(by_tag)
    assert "| all | 3 | 600 | 440 | 160 | 73.3% | 0.00 | 0.00 | 0.00 |" in table
    assert table.count("\n") == 4  # header, rule, 3 rows
    workers = worker_table(by_tag["all"])
    assert "| decode-1 | 1 | 300 | 290 | 10 | 96.7% | 0.00 |" in workers
    empty = reuse_table({"all": summarize_reuse(BenchResult((), 0.0))})
    assert "| all | 0 | 0 | 0 | 0 | - | - | - | - |" in empty

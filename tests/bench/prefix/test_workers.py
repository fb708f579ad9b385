"""The workers' counters: parsed from Prometheus text, differenced, hit rates."""

from __future__ import annotations

from bench.prefix.workers import WorkerCounters, growth, parse_counters, read_counters
from services.launcher import free_port

TEXT = """# HELP pdserve:prompt_tokens_cached_total x
pdserve:prompt_tokens_cached_total{role="prefill"} 300.0
pdserve:prompt_tokens_computed_total{role="prefill"} 100.0
pdserve:kv_transfer_bytes_total{role="prefill",transport="shm"} 4096.0
pdserve:kv_transfer_bytes_total{role="prefill",transport="tcp"} 1024.0
pdserve:prompt_tokens_cached_created{role="prefill"} 1.7e9
"""


def test_counters_are_summed_over_labels_and_differenced() -> None:
    after = parse_counters("prefill-1", TEXT)
    assert after == WorkerCounters("prefill-1", 300.0, 100.0, 5120.0)
    assert after.role == "prefill" and after.hit_rate == 0.75
    before = WorkerCounters("prefill-1", 100.0, 50.0, 1024.0)
    assert growth(before, after) == WorkerCounters("prefill-1", 200.0, 50.0, 4096.0)
    old = parse_counters("decode-0", 'pdserve:kv_transfer_bytes_total{role="decode"} 8.0\n')
    assert (old.cached, old.computed, old.kv_bytes, old.hit_rate) == (None, None, 8.0, None)
    assert growth(old, old).kv_bytes == 0.0 and growth(old, old).cached is None
    assert WorkerCounters("decode-0", 0.0, 0.0, 0.0).hit_rate is None


def test_a_worker_that_does_not_answer_reads_as_unknown() -> None:
    url = f"http://127.0.0.1:{free_port()}/metrics"
    got = read_counters({"http": "http://x/v1", "metrics:decode-1": url})
    assert got == {"decode-1": WorkerCounters("decode-1", None, None, None)}

"""Metric math on records with known event times: every expected value is worked by hand."""

from __future__ import annotations

import json

import pytest

from bench.serve.metrics import (
    Slo,
    e2e,
    is_good,
    itls,
    stats,
    summarize,
    summarize_by_tag,
    tpot,
    ttft,
)
from bench.serve.report import summary_table
from bench.serve.result import BenchResult, RequestRecord


def rec(index: int, tag: str, send: float, times: list[float], end: float, tokens: int,
        error: str | None = None) -> RequestRecord:  # fmt: skip
    return RequestRecord(
        index=index, tag=tag, send_s=send, end_s=end, token_times_s=tuple(times),
        prompt_tokens=32, completion_tokens=tokens, output_tokens_asked=tokens,
        status=500 if error else 200, error=error,
    )  # fmt: skip


# r0: 4 tokens: TTFT 100 ms, gaps 50/100/50 ms, TPOT (310-100)/3 = 70 ms, E2E 310 ms.
# r1: a single token: TTFT 200 ms, no gap, no TPOT, E2E 220 ms.
# r2: failed (HTTP 500) after one event: left out of every latency, never good.
# r3: usage says 5 tokens over 2 events: TTFT 300 ms, gap 200 ms, TPOT (600-300)/4 = 75 ms.
RECORDS = (
    rec(0, "stream", 0.0, [0.10, 0.15, 0.25, 0.30], 0.31, 4),
    rec(1, "stream", 0.5, [0.70], 0.72, 1),
    rec(2, "long", 1.0, [1.20], 1.50, 1, error="HTTP 500: boom"),
    rec(3, "long", 1.0, [1.30, 1.50], 1.60, 5),
)
RESULT = BenchResult(records=RECORDS, duration_s=2.0)


def test_per_request_metrics() -> None:
    r0, r1, _, r3 = RECORDS
    assert ttft(r0) == pytest.approx(0.10)
    assert itls(r0) == pytest.approx([0.05, 0.10, 0.05])
    assert tpot(r0) == pytest.approx(0.07)
    assert e2e(r0) == pytest.approx(0.31)
    assert ttft(r1) == pytest.approx(0.20) and itls(r1) == [] and tpot(r1) is None
    assert tpot(r3) == pytest.approx(0.075) and itls(r3) == pytest.approx([0.20])
    empty = rec(9, "x", 0.0, [], 0.5, 0, error="timed out")
    assert ttft(empty) is None and tpot(empty) is None and itls(empty) == []


def test_summary_overall() -> None:
    s = summarize(RESULT, None)
    assert (s.num_requests, s.num_ok, s.num_failed) == (4, 3, 1)
    assert s.request_throughput == pytest.approx(3 / 2.0)
    assert s.output_throughput == pytest.approx((4 + 1 + 5) / 2.0)
    assert s.total_output_tokens == 10 and s.total_prompt_tokens == 96
    # TTFT ms [100, 200, 300]: ranks (n-1)q -> p90 at 1.8, p99 at 1.98
    assert s.ttft_ms.count == 3
    assert s.ttft_ms.p50 == pytest.approx(200.0)
    assert s.ttft_ms.p90 == pytest.approx(280.0)
    assert s.ttft_ms.p99 == pytest.approx(298.0)
    assert s.ttft_ms.mean == pytest.approx(200.0)
    # ITL ms pooled [50, 50, 100, 200]: p50 at rank 1.5, p90 at 2.7, p99 at 2.97
    assert s.itl_ms.count == 4
    assert s.itl_ms.p50 == pytest.approx(75.0)
    assert s.itl_ms.p90 == pytest.approx(170.0)
    assert s.itl_ms.p99 == pytest.approx(197.0)
    assert s.itl_ms.mean == pytest.approx(100.0)
    assert s.itl_ms.max == pytest.approx(200.0)
    # TPOT ms [70, 75]; E2E ms [310, 220, 600]
    assert s.tpot_ms.count == 2 and s.tpot_ms.p50 == pytest.approx(72.5)
    assert s.e2e_ms.p50 == pytest.approx(310.0) and s.e2e_ms.max == pytest.approx(600.0)
    assert s.slo is None and s.num_good is None and s.goodput is None


def test_goodput_every_gap_and_ttft_within_slo() -> None:
    # r0 good (TTFT 100, max gap 100); r1 good (TTFT 200, no gap); r2 failed; r3 TTFT 300 > 250
    s = summarize(RESULT, Slo(ttft_ms=250, itl_ms=120))
    assert s.num_good == 2
    assert s.goodput == pytest.approx(2 / 2.0)
    assert s.good_fraction == pytest.approx(2 / 4)
    # one 100 ms gap breaks r0 under an 80 ms ITL SLO; r1 has no gap and stays good
    tight = Slo(ttft_ms=250, itl_ms=80)
    assert [is_good(r, tight) for r in RECORDS] == [False, True, False, False]
    # without a TTFT bound r3's 200 ms gap decides; the failed request is never good
    assert [is_good(r, Slo(itl_ms=200)) for r in RECORDS] == [True, True, False, True]
    assert [is_good(r, Slo()) for r in RECORDS] == [True, True, False, True]


def test_summary_per_tag_uses_the_run_duration() -> None:
    long = summarize(RESULT, Slo(ttft_ms=250), tag="long")
    assert (long.tag, long.num_requests, long.num_ok, long.num_failed) == ("long", 2, 1, 1)
    assert long.request_throughput == pytest.approx(1 / 2.0)
    assert long.output_throughput == pytest.approx(5 / 2.0)
    assert long.num_good == 0 and long.good_fraction == 0.0
    stream = summarize(RESULT, None, tag="stream")
    assert stream.ttft_ms.p50 == pytest.approx(150.0)
    assert stream.itl_ms.count == 3
    by_tag = summarize_by_tag(RESULT, None)
    assert list(by_tag) == ["all", "stream", "long"]
    only_one_tag = BenchResult(records=RECORDS[:2], duration_s=1.0)
    assert list(summarize_by_tag(only_one_tag, None)) == ["all"]


def test_empty_and_zero_duration() -> None:
    s = summarize(BenchResult(records=(), duration_s=0.0), Slo(ttft_ms=1))
    assert s.num_requests == 0 and s.request_throughput == 0.0
    assert s.ttft_ms == stats([]) and s.ttft_ms.p50 is None
    assert s.num_good == 0 and s.good_fraction is None


def test_summary_and_result_serialize() -> None:
    summaries = summarize_by_tag(RESULT, Slo(ttft_ms=250, itl_ms=120))
    d = json.loads(json.dumps({k: v.to_dict() for k, v in summaries.items()}))
    assert d["all"]["ttft_ms"]["p90"] == pytest.approx(280.0)
    assert d["all"]["slo"] == {"ttft_ms": 250, "itl_ms": 120}
    back = BenchResult.from_dict(json.loads(json.dumps(RESULT.to_dict())))
    assert back == RESULT
    table = summary_table(summaries)
    assert len(table.splitlines()) == 2 + 3  # header, rule, all + two tags
    assert "| all | 3 | 1 | 200.0/280.0/298.0 |" in table
    assert "1.000 (50%)" in table

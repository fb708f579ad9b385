"""Serving metrics from a run's records (pure functions).

Per request (successful ones; times in seconds, summaries in milliseconds):
  - TTFT: first token event - send time.
  - ITL: every gap between consecutive token events (one list per request).
  - TPOT: (E2E - TTFT) / (completion_tokens - 1); undefined for a single-token output.
  - E2E: end (after ``[DONE]``) - send time.

Summary (overall, or of one tag): counts (requests, succeeded, failed), P50/P90/P99, mean
and max of TTFT, ITL (all gaps of all requests pooled), TPOT and E2E over the successful
requests; throughput over the run's duration (t=0 to the end of the last request):
successful requests/s and their output tokens/s.

Goodput under an SLO (DistServe-style, per token): a request is *good* when it succeeded,
its TTFT <= ``Slo.ttft_ms``, and *every* one of its inter-token gaps <= ``Slo.itl_ms`` (a
single stall breaks it; a single-token output has no gap and meets any ITL SLO). A bound
left ``None`` is not checked. Failed requests are never good. Goodput = good requests /
duration; ``good_fraction`` = good / all requests (failed ones included).

Percentiles interpolate linearly between closest ranks (``bench._common.percentile``,
numpy's default).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from bench._common import percentile
from bench.serve.result import BenchResult, RequestRecord

MS = 1000.0


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds; ``None``: not checked."""

    ttft_ms: float | None = None
    itl_ms: float | None = None


@dataclass(frozen=True)
class Stats:
    """Distribution of a sample (``None`` everywhere when it is empty)."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None


@dataclass(frozen=True)
class Summary:
    """Metrics of the requests of ``tag`` (``None``: all requests) in one run."""

    tag: str | None
    num_requests: int
    num_ok: int
    num_failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_prompt_tokens: int
    total_output_tokens: int
    ttft_ms: Stats
    itl_ms: Stats
    tpot_ms: Stats
    e2e_ms: Stats
    slo: Slo | None
    num_good: int | None
    goodput: float | None
    good_fraction: float | None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def ttft(r: RequestRecord) -> float | None:
    """Seconds from send to the first token event; ``None`` without one."""
    return r.token_times_s[0] - r.send_s if r.token_times_s else None


def itls(r: RequestRecord) -> list[float]:
    """Every gap (seconds) between consecutive token events."""
    return [b - a for a, b in itertools.pairwise(r.token_times_s)]


def e2e(r: RequestRecord) -> float:
    """Seconds from send to the end of the request."""
    return r.end_s - r.send_s


def tpot(r: RequestRecord) -> float | None:
    """(E2E - TTFT) / (completion_tokens - 1); ``None`` for fewer than 2 tokens."""
    first = ttft(r)
    if first is None or r.completion_tokens < 2:
        return None
    return (e2e(r) - first) / (r.completion_tokens - 1)


def is_good(r: RequestRecord, slo: Slo) -> bool:
    """Whether ``r`` meets ``slo`` (module docstring: TTFT and every ITL within bounds)."""
    if not r.ok:
        return False
    if slo.ttft_ms is not None:
        first = ttft(r)
        if first is None or first * MS > slo.ttft_ms:
            return False
    return slo.itl_ms is None or all(gap * MS <= slo.itl_ms for gap in itls(r))


def stats(values: Sequence[float]) -> Stats:
    """Count, mean, P50/P90/P99 and max of ``values``."""
    if not values:
        return Stats(0, None, None, None, None, None)
    return Stats(
        count=len(values),
        mean=sum(values) / len(values),
        p50=percentile(values, 50.0),
        p90=percentile(values, 90.0),
        p99=percentile(values, 99.0),
        max=max(values),
    )


def summarize(result: BenchResult, slo: Slo | None, tag: str | None = None) -> Summary:
    """The summary of ``result``'s requests of ``tag`` (all when ``None``)."""
    records = [r for r in result.records if tag is None or r.tag == tag]
    ok = [r for r in records if r.ok]
    duration = result.duration_s

    def per_second(count: float) -> float:
        return count / duration if duration > 0 else 0.0

    out_tokens = sum(r.completion_tokens for r in ok)
    num_good = sum(is_good(r, slo) for r in records) if slo is not None else None
    return Summary(
        tag=tag,
        num_requests=len(records),
        num_ok=len(ok),
        num_failed=len(records) - len(ok),
        duration_s=duration,
        request_throughput=per_second(len(ok)),
        output_throughput=per_second(out_tokens),
        total_prompt_tokens=sum(r.prompt_tokens for r in ok),
        total_output_tokens=out_tokens,
        ttft_ms=stats([t * MS for r in ok if (t := ttft(r)) is not None]),
        itl_ms=stats([g * MS for r in ok for g in itls(r)]),
        tpot_ms=stats([t * MS for r in ok if (t := tpot(r)) is not None]),
        e2e_ms=stats([e2e(r) * MS for r in ok]),
        slo=slo,
        num_good=num_good,
        goodput=per_second(num_good) if num_good is not None else None,
        good_fraction=(num_good / len(records) if records else None)
        if num_good is not None
        else None,
    )


def summarize_by_tag(result: BenchResult, slo: Slo | None) -> dict[str, Summary]:
    """``{"all": overall, <tag>: that tag's summary ...}``; tags only when there are two or
    more."""
    out = {"all": summarize(result, slo)}
    tags = result.tags()
    if len(tags) > 1:
        out.update({t: summarize(result, slo, t) for t in tags})
    return out

"""The summary table printed at the end of a run (pure formatting)."""

from __future__ import annotations

from collections.abc import Mapping

from bench._common import markdown_table
from bench.serve.metrics import Stats, Summary

HEADER = (
    "tag",
    "ok",
    "failed",
    "TTFT p50/p90/p99 ms",
    "ITL p50/p90/p99 ms",
    "ITL max ms",
    "TPOT p50 ms",
    "E2E p50 ms",
    "req/s",
    "out tok/s",
    "goodput req/s (good %)",
)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _pcts(s: Stats) -> str:
    return "/".join(_ms(v) for v in (s.p50, s.p90, s.p99))


def _goodput(s: Summary) -> str:
    if s.goodput is None or s.good_fraction is None:
        return "-"
    return f"{s.goodput:.3f} ({100 * s.good_fraction:.0f}%)"


def summary_table(summaries: Mapping[str, Summary]) -> str:
    """One markdown row per summary, keyed by the name shown in the ``tag`` column."""
    rows = [
        [
            name,
            str(s.num_ok),
            str(s.num_failed),
            _pcts(s.ttft_ms),
            _pcts(s.itl_ms),
            _ms(s.itl_ms.max),
            _ms(s.tpot_ms.p50),
            _ms(s.e2e_ms.p50),
            f"{s.request_throughput:.3f}",
            f"{s.output_throughput:.1f}",
            _goodput(s),
        ]
        for name, s in summaries.items()
    ]
    return markdown_table(HEADER, rows)

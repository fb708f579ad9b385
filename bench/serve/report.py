"""The summary table printed at the end of a run, and a trace replay's headline (pure
formatting)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bench._common import markdown_table, percent_cell
from bench.serve.metrics import Stats, Summary
from bench.serve.reuse import ReuseSummary

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


def trace_plan_line(stats: Mapping[str, Any]) -> str:
    """What a trace replay sends (``TraceStats.to_dict()``), in one line."""
    s = stats
    span = s["span_s"]
    rate = f", {s['requests'] / span:.2f} req/s" if span > 0 else ""
    return (
        f"{s['requests']} requests of {s['groups']} conversations (by first hash id; the "
        f"trace: {s['trace_requests']} of {s['trace_groups']}) over {span:.1f} s{rate}; "
        f"{s['prompt_tokens']} prompt tokens (longest {s['max_prompt_tokens']}, blocks of "
        f"{s['block_tokens']}), {s['output_tokens']} output tokens asked"
    )


def trace_report(stats: Mapping[str, Any], summary: Summary, reuse: ReuseSummary) -> str:
    """A trace replay's headline: what it sent, the share of good requests under the SLO,
    the largest inter-token gap, and the cached share of prompt tokens the server reported
    beside the most a prefix cache could have skipped (``stats["reusable_share"]``)."""
    lines = [f"trace: {trace_plan_line(stats)}"]
    slo = summary.slo
    if slo is not None and summary.num_good is not None and summary.good_fraction is not None:
        bounds = []
        if slo.ttft_ms is not None:
            bounds.append(f"TTFT <= {slo.ttft_ms:g} ms")
        if slo.itl_ms is not None:
            bounds.append(f"every ITL <= {slo.itl_ms:g} ms")
        good = percent_cell(summary.good_fraction)
        lines.append(
            f"good: {summary.num_good} of {summary.num_requests} ({good}) with "
            f"{' and '.join(bounds)}"
        )
    lines.append(f"largest inter-token gap: {_ms(summary.itl_ms.max)} ms")
    ceiling = percent_cell(stats["reusable_share"])
    if reuse.total.requests:
        cached = (
            f"{percent_cell(reuse.total.hit_rate)} ({reuse.total.cached_tokens} of "
            f"{reuse.total.prompt_tokens}, as the server reported)"
        )
    else:
        cached = "not reported by the server"
    lines.append(f"cached share of prompt tokens: {cached}; the trace allows at most {ceiling}")
    return "\n".join(lines)

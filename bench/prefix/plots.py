"""The report's figure (matplotlib, non-interactive Agg canvas, like ``bench.serve.plots``):
per workload, the TTFT CDF of each policy, and a bar chart of prompt tokens computed vs
cached (the requests' usage) for every (workload, policy)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from bench.prefix.report import PrefixReport
from bench.serve.metrics import MS, ttft
from bench.serve.plots import ecdf, save_png


def plot_report(report: PrefixReport, path: Path) -> None:
    """Write the figure to ``path`` (PNG)."""
    workloads = list(dict.fromkeys(r.workload for r in report.runs))
    if not workloads:
        raise ValueError("no runs to plot")
    fig = Figure(figsize=(5.0 * (len(workloads) + 1), 4.0), layout="constrained")
    axes = fig.subplots(1, len(workloads) + 1, squeeze=False)[0]
    for ax, workload in zip(axes, workloads, strict=False):
        for r in report.runs:
            if r.workload == workload:
                ok = [x for x in r.result.records if x.ok]
                ecdf(ax, [t * MS for x in ok if (t := ttft(x)) is not None], r.policy)
        ax.set_title(f"{workload}: TTFT CDF")
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right", fontsize="small")
    bars = axes[-1]
    labels = [f"{r.workload}\n{r.policy}" for r in report.runs]
    computed = [r.figures.computed_tokens for r in report.runs]
    cached = [r.figures.cached_tokens for r in report.runs]
    xs = range(len(report.runs))
    bars.bar(xs, computed, label="computed")
    bars.bar(xs, cached, bottom=computed, label="cached", alpha=0.6)
    bars.set_xticks(list(xs), labels, fontsize="x-small", rotation=30, ha="right")
    bars.set_ylabel("prompt tokens")
    bars.set_title("prompt tokens: computed vs cached")
    bars.grid(alpha=0.3, axis="y")
    bars.legend(fontsize="small")
    save_png(fig, path)

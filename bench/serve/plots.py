"""PNG figures of one or several labelled runs (matplotlib, non-interactive Agg canvas).

- ``plot_itl_over_time``: one subplot per run, y shared: every inter-token gap of each
  ``"stream"`` request (all requests when a run has no streams) at the time its token
  arrived, one line per request, and a dashed vertical line at each ``"long"`` request's
  send time. The interference experiment puts colocated and disaggregated side by side.
- ``plot_cdfs``: empirical CDFs of TTFT and ITL (successful requests), one line per run.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from bench.serve.metrics import MS, itls, ttft
from bench.serve.result import BenchResult, RequestRecord
from bench.serve.workload import TAG_LONG, TAG_STREAM


def _streams(result: BenchResult) -> list[RequestRecord]:
    streams = [r for r in result.records if r.tag == TAG_STREAM]
    return streams or [r for r in result.records if r.tag != TAG_LONG]


def save_png(fig: Figure, path: Path) -> None:
    """Write ``fig`` to ``path`` as a PNG, creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, format="png", dpi=110)


def plot_itl_over_time(results: Mapping[str, BenchResult], path: Path) -> None:
    """ITL of the decode streams over time, one subplot per labelled run, written to ``path``."""
    if not results:
        raise ValueError("no results to plot")
    n = len(results)
    fig = Figure(figsize=(6.0 * n, 4.0), layout="constrained")
    axes = fig.subplots(1, n, sharex=True, sharey=True, squeeze=False)[0]
    for ax, (label, result) in zip(axes, results.items(), strict=True):
        for r in _streams(result):
            gaps = itls(r)
            if gaps:
                # A gap spans the time before the token that ends it: "steps-pre" draws each
                # gap over that interval, so a stall shows as a plateau, not as a ramp.
                ax.plot(
                    r.token_times_s[1:],
                    [g * MS for g in gaps],
                    lw=0.8,
                    alpha=0.8,
                    drawstyle="steps-pre",
                )
        arrivals = [r.send_s for r in result.records if r.tag == TAG_LONG]
        for i, t in enumerate(arrivals):
            ax.axvline(
                t, color="black", ls="--", lw=0.7, label="long prompt sent" if i == 0 else None
            )
        if arrivals:
            ax.legend(loc="upper right", fontsize="small")
        ax.set_title(label)
        ax.set_xlabel("time since start (s)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("inter-token latency (ms)")
    save_png(fig, path)


def ecdf(ax: Axes, values: list[float], label: str) -> None:
    """The empirical CDF of ``values`` as a step line on ``ax`` (nothing when empty)."""
    if not values:
        return
    xs = sorted(values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def plot_cdfs(results: Mapping[str, BenchResult], path: Path) -> None:
    """CDFs of TTFT and ITL (ms) of each labelled run on one figure, written to ``path``."""
    if not results:
        raise ValueError("no results to plot")
    fig = Figure(figsize=(11.0, 4.0), layout="constrained")
    ax_ttft, ax_itl = fig.subplots(1, 2)
    for label, result in results.items():
        ok = [r for r in result.records if r.ok]
        ecdf(ax_ttft, [t * MS for r in ok if (t := ttft(r)) is not None], label)
        ecdf(ax_itl, [g * MS for r in ok for g in itls(r)], label)
    for ax, name in ((ax_ttft, "TTFT"), (ax_itl, "ITL")):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"{name} CDF")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right", fontsize="small")
    save_png(fig, path)

"""Helpers shared by the benchmarks: statistics, copy bandwidth, machine facts, JSON output.

Everything here is either a pure function (statistics, formatting) or a measurement that
touches nothing but its own buffers, so benchmarks can call it in any order.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import time
from collections.abc import Iterator, Sequence, Set
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch


@contextmanager
def pinned(cpus: Set[int] | None) -> Iterator[None]:
    """Run the calling thread (and the threads it starts) on ``cpus`` inside the block;
    ``None`` or empty: leave the affinity alone."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def median(values: Sequence[float]) -> float:
    """The median of a non-empty sequence (mean of the two middle values when even)."""
    return percentile(values, 50.0)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks.

    Same definition as ``numpy.percentile``'s default. Raises ``ValueError`` on an empty
    sequence or ``q`` outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or ``None`` when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def rate(count: float, seconds: float) -> float:
    """Items per second; raises ``ValueError`` on a non-positive duration."""
    if seconds <= 0:
        raise ValueError(f"duration must be positive, got {seconds}")
    return count / seconds


@dataclass(frozen=True)
class CopyBandwidth:
    """A large tensor ``copy_``: ``nbytes`` copied in ``best_s`` (fastest of ``repeats``)."""

    nbytes: int
    best_s: float
    repeats: int

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.best_s


def measure_copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> CopyBandwidth:
    """Time ``dst.copy_(src)`` of ``nbytes`` on the current torch thread count; keep the best.

    Bandwidth is counted as bytes copied (not read + written), the convention of
    ``/work/shared/MACHINE.md``. Both buffers are touched first so page faults are not timed.
    Pick ``nbytes`` well above the last-level cache or the figure is a cache bandwidth.
    """
    if nbytes < 4 or repeats < 1:
        raise ValueError("nbytes must be >= 4 and repeats >= 1")
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.zeros(n, dtype=torch.float32)
    dst.copy_(src)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return CopyBandwidth(nbytes=n * 4, best_s=best, repeats=repeats)


def load_average() -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages (zeros where the OS has none)."""
    try:
        return os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)


def machine_info() -> dict[str, object]:
    """CPU model and core count (from ``lscpu`` where available), OS and library versions."""
    model = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                model = value.strip()
                break
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def write_json(path: str | Path, payload: object) -> None:
    """Write ``payload`` as indented JSON, creating parent folders."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured markdown table; every row must have ``len(header)`` cells."""
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row {list(row)} has {len(row)} cells, header has {len(header)}")
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def percent_cell(value: float | None) -> str:
    """A table cell: a fraction as a percentage with one decimal, ``-`` when missing."""
    return "-" if value is None else f"{100 * value:.1f}%"


def mib_cell(value: float | None) -> str:
    """A table cell: bytes in MiB with two decimals, ``-`` when missing."""
    return "-" if value is None else f"{value / (1 << 20):.2f}"

"""The figures are written as valid PNG images of the expected layout."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pytest

from bench.serve.plots import plot_cdfs, plot_itl_over_time
from bench.serve.result import BenchResult, RequestRecord

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(spike_ms: float) -> BenchResult:
    records = []
    for i in range(3):
        times = [0.1 + 0.05 * k for k in range(40)]
        times[20:] = [t + spike_ms / 1000 for t in times[20:]]  # a stall after token 20
        records.append(RequestRecord(i, "stream", 0.01 * i, times[-1] + 0.01, tuple(times),
                                     32, 40, 40, 200))  # fmt: skip
    records.append(RequestRecord(3, "long", 1.05, 2.0, (1.9, 1.95), 1024, 2, 2, 200))
    records.append(RequestRecord(4, "long", 1.5, 3.0, (), 1024, 0, 2, 0, error="timed out"))
    return BenchResult(tuple(records), duration_s=3.0)


def _image_shape(path: Path) -> tuple[int, ...]:
    assert path.read_bytes()[:8] == PNG_MAGIC
    return matplotlib.image.imread(path).shape


def test_itl_over_time_side_by_side(tmp_path: Path) -> None:
    one = tmp_path / "one.png"
    two = tmp_path / "sub" / "two.png"
    plot_itl_over_time({"colocated": _run(400.0)}, one)
    plot_itl_over_time({"colocated": _run(400.0), "disaggregated": _run(0.0)}, two)
    h1, w1, _ = _image_shape(one)
    h2, w2, _ = _image_shape(two)
    assert h1 == h2 and w2 == 2 * w1  # one subplot per labelled run


def test_cdfs_of_several_runs(tmp_path: Path) -> None:
    path = tmp_path / "cdf.png"
    plot_cdfs({"a": _run(400.0), "b": _run(0.0), "empty": BenchResult((), 0.0)}, path)
    assert len(_image_shape(path)) == 3
    with pytest.raises(ValueError):
        plot_cdfs({}, path)
    with pytest.raises(ValueError):
        plot_itl_over_time({}, path)

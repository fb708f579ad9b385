"""Arrival patterns: fixed rate exactly, seeded Poisson statistically."""

from __future__ import annotations

import itertools
import statistics

import pytest

from bench.serve.arrival import (
    Concurrency,
    FixedRate,
    Poisson,
    Schedule,
    describe,
    open_loop_offsets,
)


def test_fixed_rate_is_exact() -> None:
    assert open_loop_offsets(FixedRate(4.0), 5) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert open_loop_offsets(FixedRate(0.5), 3) == [0.0, 2.0, 4.0]
    assert open_loop_offsets(FixedRate(1.0), 0) == []


def test_poisson_is_seeded_with_the_right_mean_gap() -> None:
    offsets = open_loop_offsets(Poisson(rate=5.0, seed=7), 20_000)
    assert offsets[0] == 0.0
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 5.0, rel=0.03)
    # exponential gaps: the standard deviation equals the mean (a fixed rate would give 0)
    assert statistics.stdev(gaps) == pytest.approx(1 / 5.0, rel=0.05)
    assert open_loop_offsets(Poisson(5.0, seed=7), 50) == offsets[:50]
    assert open_loop_offsets(Poisson(5.0, seed=8), 50) != offsets[:50]


def test_bad_patterns_and_description() -> None:
    for bad in (lambda: Poisson(0.0), lambda: FixedRate(-1.0), lambda: Concurrency(0)):
        with pytest.raises(ValueError):
            bad()
    assert describe(Poisson(2.0, seed=3)) == {"kind": "poisson", "rate": 2.0, "seed": 3}
    assert describe(FixedRate(2.0)) == {"kind": "rate", "rate": 2.0}
    assert describe(Concurrency(4)) == {"kind": "concurrency", "limit": 4}
    assert describe(Schedule()) == {"kind": "schedule"}

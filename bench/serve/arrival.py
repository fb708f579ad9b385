"""Arrival patterns: when each request is sent (pure functions).

- ``Poisson(rate, seed)``: open loop, exponential gaps with mean ``1 / rate`` (seeded);
  the first request goes at t=0.
- ``FixedRate(rate)``: open loop, request ``i`` at ``i / rate``.
- ``Concurrency(limit)``: closed loop, ``limit`` requests in flight; each finished request
  is replaced by the next at once.
- ``Schedule()``: every request at its own ``RequestSpec.start_offset_s`` (0 when unset).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Poisson:
    rate: float
    seed: int = 0

    def __post_init__(self) -> None:
        _check_rate(self.rate)


@dataclass(frozen=True)
class FixedRate:
    rate: float

    def __post_init__(self) -> None:
        _check_rate(self.rate)


@dataclass(frozen=True)
class Concurrency:
    limit: int

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.limit}")


@dataclass(frozen=True)
class Schedule:
    pass


Arrival = Poisson | FixedRate | Concurrency | Schedule


def open_loop_offsets(arrival: Poisson | FixedRate, n: int) -> list[float]:
    """Send times (seconds after the start) of ``n`` requests; non-decreasing, first 0."""
    if isinstance(arrival, FixedRate):
        return [i / arrival.rate for i in range(n)]
    rng = random.Random(arrival.seed)
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(arrival.rate)
    return offsets


def describe(arrival: Arrival) -> dict[str, object]:
    """The pattern as JSON-ready config."""
    kind = {Poisson: "poisson", FixedRate: "rate", Concurrency: "concurrency", Schedule: "schedule"}
    return {"kind": kind[type(arrival)], **vars(arrival)}


def _check_rate(rate: float) -> None:
    if not rate > 0:
        raise ValueError(f"rate must be positive, got {rate}")

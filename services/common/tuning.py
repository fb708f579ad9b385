"""``Tuning``: the speed knobs of a process that runs an engine (a worker, the gateway's
local backend), in one place: settings that change no output and no capacity, only how soon
tokens reach the client.

A knob stays here only while a benchmark shows it move a figure a user sees: ITL, TTFT, or
the delay the serving path adds to each token on its way to the client ("token delay").
The runs and their commands are in docs/benchmarks.md at the commit named.

- ``delivery_wait_ms`` (2 ms) and ``switch_interval_ms`` (0.5 ms), measured together on the
  workers: disaggregated ITL P50 / P99 112 / 146 -> 93 / 122 ms (``bench.interference``,
  "Interference", e7db6f6); serving hop token delay P99, worker path 8.9 -> 1.71 ms,
  gateway path 2.25 -> 1.39 ms (``bench.transfer``, "Serving hop", e7db6f6).
- ``switch_interval_ms`` on the gateway, with its stream-start log moved after the first
  event (a first token had waited 0.3-3 ms there): gateway hop token delay P99 1.49-2.00 ->
  1.21-1.45 ms (``bench.transfer``, 36c669b).
- ``engine_cpus`` (not pinned; ``pdserve up --pin`` sets it): worker token delay P99
  1.82-6.33 ms with every thread on the engine core, 1.12-1.81 ms with the engine thread
  alone there (``bench.transfer --hop-whole-pin``, c60c329; 1be0c0c).

Gone for want of such a figure (what they moved was KV transfer throughput on one host):
``SCHED_BATCH`` on the KV writer's owner thread, the check that spared a post its eventfd
write, and the tcp transport's congestion control (``--kv-tcp-congestion``).

Applied once, at start, by the process shell (``services.common.process.run``) and where
the ``AsyncEngine`` is built (``engine_options``): engine/ and transfer/ take values as
parameters and never read this module.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from services.common.settings import cpu_list, setting


@dataclass(frozen=True)
class Tuning:
    """The speed knobs of one process that runs an engine. ``ValueError`` on a value out of
    range."""

    switch_interval_ms: float = setting(
        0.5,
        "Python's thread switch interval. The engine thread holds the GIL in its Python "
        "parts; this bounds how long the thread sending tokens waits for it (Python's own "
        "default is 5 ms)",
        metavar="MS",
    )
    engine_cpus: frozenset[int] | None = setting(
        None,
        "pin the engine thread (and the torch threads it starts) to these cores (comma "
        "list). The event loop, gRPC and KV writer threads keep all the process's cores, so "
        "with more cores than these they run beside a step's compute instead of waiting for "
        "the CPU (pdserve up --pin sets it when control cores are free; none: not pinned)",
        parse=cpu_list,
        metavar="CPUS",
    )
    delivery_wait_ms: float = setting(
        2.0,
        "after each step, how long the engine thread waits for the event loop to send that "
        "step's tokens before computing the next (0: no wait)",
        metavar="MS",
    )

    def __post_init__(self) -> None:
        if not 0 < self.switch_interval_ms <= 100:
            raise ValueError(
                f"switch_interval_ms must be in (0, 100] ms, got {self.switch_interval_ms}"
            )
        if self.delivery_wait_ms < 0:
            raise ValueError(f"delivery_wait_ms must be >= 0, got {self.delivery_wait_ms}")

    def apply(self) -> float:
        """Set this process's thread switch interval; returns it, in seconds.

        A worker has two busy threads: the engine thread (Python between torch ops) and the
        event loop that streams tokens. When one wants the GIL the other holds, it waits up
        to the switch interval, which lands directly on every token's delivery.
        """
        sys.setswitchinterval(self.switch_interval_ms / 1000.0)
        return sys.getswitchinterval()

    def engine_options(self) -> dict[str, Any]:
        """The ``AsyncEngine`` keyword arguments these knobs set."""
        return {"cpus": self.engine_cpus, "delivery_wait_s": self.delivery_wait_ms / 1000.0}

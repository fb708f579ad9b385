"""``Tuning``: how a process that runs an engine (a worker, the gateway's local backend)
lays out its threads. Applied once, at start, by the process shell
(``services.common.process.run``) and where the ``AsyncEngine`` is built
(``engine_options``); nothing on the request path reads it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from services.common.settings import cpu_list, setting


@dataclass(frozen=True)
class Tuning:
    """The thread layout of one process. ``ValueError`` on a value out of range."""

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
        """The ``AsyncEngine`` keyword arguments this layout sets."""
        return {"cpus": self.engine_cpus, "delivery_wait_s": self.delivery_wait_ms / 1000.0}

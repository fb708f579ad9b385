"""Keeps ``pdserve up``'s stack serving: a process that dies is restarted after a backoff,
within a restart budget, while the rest keep serving.

Lifecycle of a dead process (``Supervisor.tick``, called every half second): found dead ->
restartable? (else the stack stops; ``pdserve up`` restarts every process) -> within its
budget (``RestartPolicy.budget`` restarts in ``window_s``)? else an essential process (the
control plane) stops the stack, any other (a worker, the KV store's master) is given up on
and stays down while the rest keep serving -> restart
due after ``RestartPolicy.delay`` (doubling from ``first_delay_s`` up to ``max_delay_s``) ->
restarted with the same command line, so on the same port. A restarted worker registers
again under its worker id, which replaces its dead incarnation at the scheduler at once; a
restarted scheduler reloads the registry from Redis; a restarted Redis reloads its
append-only file and the scheduler writes its registry and prefix index to it again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from services.launcher import Proc, Stack


@dataclass(frozen=True)
class RestartPolicy:
    """How soon and how often one process may be restarted."""

    first_delay_s: float = 0.5
    max_delay_s: float = 10.0
    budget: int = 5  # restarts of one process ...
    window_s: float = 60.0  # ... within this many seconds

    def __post_init__(self) -> None:
        if not 0 <= self.first_delay_s <= self.max_delay_s:
            raise ValueError("need 0 <= first_delay_s <= max_delay_s")
        if self.budget < 0 or self.window_s <= 0:
            raise ValueError("need budget >= 0 and window_s > 0")

    def delay(self, recent: int) -> float:
        """Seconds to wait before the next restart, after ``recent`` restarts in the window."""
        return min(self.max_delay_s, self.first_delay_s * 2**recent)

    def recent(self, restarts: Sequence[float], now: float) -> int:
        """How many of ``restarts`` (monotonic times) fall in the window before ``now``."""
        return sum(1 for t in restarts if now - t < self.window_s)


class Supervisor:
    """Restarts a ``Stack``'s dead ``restartable`` processes under ``policy``.

    ``tick`` returns None while the stack can go on, or why it must stop. ``say`` receives a
    line for the operator about every death and restart. ``essential``: the processes
    without which the stack cannot serve (default: every restartable one); one of them
    past its budget stops the stack, any other is given up on (``given_up``).
    """

    def __init__(
        self,
        stack: Stack,
        restartable: Collection[str],
        policy: RestartPolicy,
        say: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        essential: Collection[str] | None = None,
    ) -> None:
        self.stack = stack
        self.restartable = set(restartable)
        self.essential = self.restartable if essential is None else set(essential)
        self.given_up: set[str] = set()
        self.policy = policy
        self.say = say
        self.clock = clock
        self.restarts: dict[str, list[float]] = {}
        self._due: dict[str, float] = {}  # name -> when to restart it

    def tick(self) -> str | None:
        now = self.clock()
        for proc in self.stack.dead():
            if proc.name in self._due or proc.name in self.given_up:
                continue
            code = proc.popen.returncode if proc.popen is not None else None
            if proc.name not in self.restartable:
                return f"{proc.name} exited ({code}); it is not restarted, so the stack stops"
            recent = self.policy.recent(self.restarts.get(proc.name, []), now)
            if recent >= self.policy.budget:
                why = (f"{proc.name} exited ({code}) after {recent} restarts within "
                       f"{self.policy.window_s:.0f} s")  # fmt: skip
                if proc.name in self.essential:
                    return f"{why}; stopping"
                self.given_up.add(proc.name)
                self.say(f"{why}; giving up on it, the rest keep serving")
                continue
            delay = self.policy.delay(recent)
            self._due[proc.name] = now + delay
            self.say(f"{proc.name} exited ({code}); restarting it in {delay:.1f} s")
        for name, due in list(self._due.items()):
            if now >= due:
                del self._due[name]
                self._restart(self.stack.named(name), now)
        return None

    def _restart(self, proc: Proc, now: float) -> None:
        self.restarts.setdefault(proc.name, []).append(now)
        self.stack.restart(proc)
        self.say(f"{proc.name} restarted (pid {proc.popen.pid if proc.popen else '?'})")

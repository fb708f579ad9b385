"""Fault injection for the KV data plane: what a failing link or peer does, on purpose.

A ``FaultSpec`` is parsed from text such as ``"fail_rate=0.05,delay_ms=20,seed=7"`` (a
service's ``--faults`` setting, ``services.common.faults.FaultArgs``, which also says whether
this is production). Off by default; a spec parsed for production is refused unless it says
``force=1``. A writer's owner thread asks its ``FaultDice`` right before it moves the bytes
of a layer run:

- ``fail_rate`` / ``fail_every``: the job fails there (an injected ``TransferError``), after
  its first run moved: some bytes landed, as when a link dies mid-transfer;
- ``delay_ms``: every run waits this long first (a slow link; the owner is busy meanwhile);
- ``stall_ms``: once per job, the owner freezes just before moving bytes, after its abort and
  deadline checks (a writer descheduled or stopped mid-copy): what it moves when it wakes
  is a late write, the case KV fencing exists for;
- ``drop_every``: every Nth job's connection is dropped (tcp) before its first run.

The same spec drives the process's internal gRPC clients (``services/common/faults.py``):
``rpc_fail_every``: every Nth call fails with ``UNAVAILABLE`` before it is sent;
``rpc_delay_ms``: every call waits this long first.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, fields

from transfer.errors import TransferError


class InjectedFault(TransferError):
    """A failure a fault spec asked for."""


@dataclass(frozen=True)
class FaultSpec:
    fail_rate: float = 0.0
    fail_every: int = 0
    delay_ms: float = 0.0
    stall_ms: float = 0.0
    drop_every: int = 0
    rpc_fail_every: int = 0
    rpc_delay_ms: float = 0.0
    seed: int = 0
    force: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.fail_rate <= 1.0:
            raise ValueError(f"fail_rate={self.fail_rate} must be in [0, 1]")
        for name in (
            "fail_every", "delay_ms", "stall_ms", "drop_every", "rpc_fail_every", "rpc_delay_ms"
        ):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")

    def __str__(self) -> str:
        """The spec as ``parse`` reads it: the fields that differ from the defaults."""
        return ",".join(
            f"{f.name}={int(v) if isinstance(v, bool) else v}"
            for f in fields(self)
            if (v := getattr(self, f.name)) != f.default
        )

    @property
    def active(self) -> bool:
        return self.transfer_active or self.rpc_active

    @property
    def transfer_active(self) -> bool:
        return bool(
            self.fail_rate or self.fail_every or self.delay_ms or self.stall_ms or self.drop_every
        )

    @property
    def rpc_active(self) -> bool:
        return bool(self.rpc_fail_every or self.rpc_delay_ms)

    @classmethod
    def parse(cls, text: str, *, production: bool = False) -> FaultSpec:
        """``key=value`` pairs, comma-separated; empty text is no faults. Raises
        ``ValueError`` naming the bad part; refuses an active spec in ``production`` unless
        forced."""
        types = {f.name: f.type for f in fields(cls)}
        values: dict[str, object] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = part.partition("=")
            key = key.strip()
            if not sep or key not in types:
                raise ValueError(f"fault spec: {part!r} is not one of {sorted(types)} as key=value")
            kind = types[key]
            try:
                if kind == "bool":
                    values[key] = raw.strip() in ("1", "true", "yes")
                elif kind == "int":
                    values[key] = int(raw)
                else:
                    values[key] = float(raw)
            except ValueError:
                raise ValueError(f"fault spec: {key}={raw!r} is not a {kind}") from None
        spec = cls(**values)  # type: ignore[arg-type]
        if spec.active and production and not spec.force:
            raise ValueError(
                f"fault spec {text!r} refused in production (add force=1 to inject anyway)"
            )
        return spec


NO_FAULTS = FaultSpec()


class FaultDice:
    """A spec's decisions, job by job: shared by a transport's writers (any owner thread)."""

    def __init__(self, spec: FaultSpec) -> None:
        self.spec = spec
        self._lock = threading.Lock()
        self._rng = random.Random(spec.seed)
        self._jobs = 0
        self.injected = 0  # faults that happened (fail, stall, drop)

    def job_fate(self) -> tuple[bool, bool, bool]:
        """For a job starting now: ``(fail, stall, drop)``."""
        p = self.spec
        with self._lock:
            self._jobs += 1
            n = self._jobs
            fail = bool(p.fail_every and n % p.fail_every == 0)
            fail = fail or (p.fail_rate > 0 and self._rng.random() < p.fail_rate)
            drop = bool(p.drop_every and n % p.drop_every == 0)
            stall = p.stall_ms > 0
            self.injected += fail + drop + stall
        return fail, stall, drop

    def delay(self) -> None:
        if self.spec.delay_ms:
            time.sleep(self.spec.delay_ms / 1000)

    def stall(self) -> None:
        time.sleep(self.spec.stall_ms / 1000)

"""The chaos run's report: counts, KV and shm accounting, greedy mismatches, and the
acceptance verdict (pure: a ``ChaosReport`` in, checks and text out)."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.chaos.client import Outcome

COMPLETED_FRACTION = 0.99
_ID = re.compile(r"[0-9a-f]{12,}")


@dataclass(frozen=True)
class Mismatch:
    index: int
    request_id: str
    question: str
    migrated: bool
    got: str
    want: str


@dataclass(frozen=True)
class ChaosReport:
    """Everything one chaos run measured. ``disrupted``: workers killed (and restarted) in
    the run, excluded from the free-block check; ``shm_left``: segments that were not in
    ``/dev/shm`` before the stack started and still are after it stopped."""

    config: dict[str, Any]
    date: str
    wall_s: float
    phases_s: dict[str, float]
    requests: int
    completed: int
    failed: int
    hung: int
    error_causes: dict[str, int]
    hung_requests: list[dict[str, Any]]
    migrations_by_cause: dict[str, float]
    migrated_requests: dict[str, list[str]]
    migrated_completed: int
    mismatches: list[Mismatch]
    free_blocks_before: dict[str, int | None]
    free_blocks_after: dict[str, int | None]
    free_blocks_wait_s: float
    disrupted: dict[str, str]
    shm_bytes_before: int
    shm_bytes_after: int
    shm_left: dict[str, int]
    shm_swept: list[str]
    kills: list[dict[str, Any]]
    supervisor: list[str]
    supervisor_stopped: str | None
    outcomes: list[dict[str, Any]]
    kv_store: dict[str, float] = field(default_factory=dict)

    @property
    def migrated_mismatches(self) -> list[Mismatch]:
        return [m for m in self.mismatches if m.migrated]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "checks": acceptance(self)}


def error_cause(message: str) -> str:
    """An error message with request and segment ids blanked, so equal causes group."""
    return _ID.sub("…", message)


def count_outcomes(outcomes: Iterable[Outcome]) -> tuple[int, int, int, dict[str, int]]:
    """``(completed, cleanly failed, hung, failure cause -> count)``."""
    outs = list(outcomes)
    causes = Counter(error_cause(o.error) for o in outs if o.error and not o.hung)
    completed = sum(o.completed for o in outs)
    hung = sum(o.hung for o in outs)
    return completed, len(outs) - completed - hung, hung, dict(causes.most_common())


def mismatches(
    outcomes: Iterable[Outcome], reference: Mapping[str, str], migrated: Mapping[str, object]
) -> list[Mismatch]:
    """Completed streams whose text differs from the greedy reference of their question."""
    return [
        Mismatch(
            o.index,
            o.request_id,
            o.question,
            o.request_id in migrated,
            o.text,
            reference[o.question],
        )
        for o in outcomes
        if o.completed and o.text != reference[o.question]
    ]


def acceptance(r: ChaosReport) -> dict[str, bool]:
    """The chaos acceptance, one verdict per point:

    1. no request hung;
    2. at least 99% of the requests completed;
    3. every completed migrated stream equals the greedy reference;
    4. every worker that was not killed has as many free KV blocks after the run as before;
    5. no ``pdserve-kv-*`` segment of the run is left in ``/dev/shm`` after the stack stopped;
    6. with the KV store: no object a load read was refused (size or header not the block
       its key names: wrong KV would have been loaded without the check).
    """
    survivors = [w for w in r.free_blocks_before if w not in r.disrupted]
    return {
        "0 hung": r.hung == 0,
        ">= 99% completed": r.completed >= math.ceil(COMPLETED_FRACTION * r.requests),
        "0 greedy mismatches among migrated": not r.migrated_mismatches,
        "free KV blocks after = before (survivors)": all(
            r.free_blocks_before[w] is not None
            and r.free_blocks_after.get(w) == r.free_blocks_before[w]
            for w in survivors
        ),
        "0 pdserve-kv-* bytes left after stop": sum(r.shm_left.values()) == 0,
        **(
            {"0 KV store blocks refused": r.kv_store.get("refused_blocks", 0.0) == 0}
            if r.kv_store
            else {}
        ),
    }


def render(r: ChaosReport) -> str:
    """The report as a plain-text table."""
    pct = 100.0 * r.completed / r.requests if r.requests else 0.0
    rows = [
        ("requests", str(r.requests)),
        ("completed", f"{r.completed} ({pct:.1f}%)"),
        ("cleanly failed", str(r.failed)),
        ("hung", str(r.hung)),
        (
            "migrations (gateway metric)",
            ", ".join(f"{c}={v:g}" for c, v in sorted(r.migrations_by_cause.items())) or "-",
        ),
        (
            "migrated requests (gateway log)",
            f"{len(r.migrated_requests)} ({r.migrated_completed} completed)",
        ),
        ("greedy mismatches (all)", str(len(r.mismatches))),
        ("greedy mismatches (migrated)", str(len(r.migrated_mismatches))),
        (
            "KV store (workers' counters)",
            ", ".join(f"{k} {v:g}" for k, v in r.kv_store.items()) or "-",
        ),
        (
            "/dev/shm pdserve-kv-* bytes",
            f"before {r.shm_bytes_before}, after {r.shm_bytes_after}, "
            f"left by this run {sum(r.shm_left.values())}",
        ),
        (
            "wall time",
            f"{r.wall_s:.1f} s ("
            + ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in r.phases_s.items())
            + ")",
        ),
    ]
    lines = [f"{k:<34} {v}" for k, v in rows]
    if r.error_causes:
        lines.append("failure causes:")
        lines += [f"  {n:>4} x {cause}" for cause, n in r.error_causes.items()]
    lines.append(f"free KV blocks (after waiting {r.free_blocks_wait_s:.1f} s):")
    for w, before in r.free_blocks_before.items():
        note = f"  [{r.disrupted[w]}]" if w in r.disrupted else ""
        lines.append(f"  {w:<12} before {before}  after {r.free_blocks_after.get(w)}{note}")
    for k in r.kills:
        lines.append(
            f"kill -9 {k['target']} (pid {k['pid']}) after {k['after']} finished, "
            f"t={k['t_s']:.1f} s"
        )
    lines += [f"supervisor: {s}" for s in r.supervisor]
    if r.supervisor_stopped:
        lines.append(f"supervisor stopped the stack: {r.supervisor_stopped}")
    for h in r.hung_requests:
        lines.append(f"HUNG: #{h['index']} {h['request_id'] or '(no id)'} {h['question']!r}")
    for m in r.mismatches:
        lines.append(
            f"MISMATCH{' (migrated)' if m.migrated else ''}: #{m.index} "
            f"{m.request_id}: got {m.got!r} want {m.want!r}"
        )
    lines.append("acceptance:")
    checks = acceptance(r)
    lines += [f"  {'PASS' if ok else 'FAIL'}  {name}" for name, ok in checks.items()]
    lines.append("PASS" if all(checks.values()) else "FAIL")
    return "\n".join(lines)

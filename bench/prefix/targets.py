"""What one (policy, workload) run measured, and the targets (pure: records in, verdicts out).

Targets, each cache-aware against round-robin on the same workload (long-document:
cache-aware with the KV store against cache-aware without, and 1/3 for 1/2):

1. TTFT P50 (successful requests) at most half of round-robin's.
2. Prompt tokens computed at most half of round-robin's: the workers' own
   ``prompt_tokens_computed_total`` growth over the workload, summed over workers, where every
   worker exports it; otherwise the requests' usage (prompt - cached).
3. Multi-turn only: every later turn moves at most the KV of its new tokens plus one block
   per layer: ``kv_transfer_bytes <= (ceil(new / block_size) + 1) * block_bytes``, where
   ``new`` = its prompt minus the previous turn's whole sequence (prompt + answer), whose KV
   the decode worker may already hold, and ``block_bytes`` = one block's keys and values
   over all layers. A turn prefilled on its decode worker moves 0 bytes and passes.

A target is ``None`` (not judged) when a side is missing or measured nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from bench._common import percentile, ratio
from bench.prefix.config import BASELINE, CANDIDATE, STORE_BASELINE, STORE_CANDIDATE
from bench.prefix.workers import WorkerCounters
from bench.serve.metrics import MS, e2e, itls, ttft
from bench.serve.result import BenchResult, RequestRecord

HALF = 0.5
THIRD = 1 / 3


@dataclass(frozen=True)
class KvLayout:
    """``block_size`` tokens a block; ``block_bytes``: one block's KV over every layer."""

    block_size: int
    block_bytes: int


@dataclass(frozen=True)
class BytesCheck:
    """One later turn's KV bytes against its bound (target 3)."""

    session: int
    turn: int
    new_tokens: int
    bound_bytes: int
    kv_bytes: int | None

    @property
    def ok(self) -> bool | None:
        return None if self.kv_bytes is None else self.kv_bytes <= self.bound_bytes


def bytes_checks(result: BenchResult, layout: KvLayout) -> list[BytesCheck]:
    """Target 3's check of every successful later turn whose previous turn succeeded."""
    by_turn: dict[tuple[int, int], RequestRecord] = {
        (r.session, r.turn): r
        for r in result.records
        if r.ok and r.session is not None and r.turn is not None
    }
    out = []
    for (session, turn), r in sorted(by_turn.items(), key=lambda kv: kv[0]):
        prev = by_turn.get((session, turn - 1))
        if prev is None:
            continue
        new = max(0, r.prompt_tokens - prev.prompt_tokens - prev.completion_tokens)
        bound = (math.ceil(new / layout.block_size) + 1) * layout.block_bytes
        out.append(BytesCheck(session, turn, new, bound, r.kv_transfer_bytes))
    return out


@dataclass(frozen=True)
class RunFigures:
    """The figures of one workload under one policy (``None``: not measured).

    ``computed_tokens`` / ``cached_tokens``: the requests' usage; ``worker_computed``: the
    workers' computed counters' growth, summed (their cached counters are not summed: a
    prefix held by both the prefill and the decode worker counts on each). ``bytes_*``:
    target 3 over the later turns (``bytes_unknown``: turns whose server did not say).
    """

    policy: str
    workload: str
    requests: int
    failed: int
    ttft_p50_ms: float | None
    later_ttft_p50_ms: float | None
    e2e_p50_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    prompt_tokens: int
    computed_tokens: int
    cached_tokens: int
    worker_computed: float | None
    kv_bytes_mean: float | None
    later_kv_bytes_mean: float | None
    bytes_ok: int
    bytes_checked: int
    bytes_unknown: int

    @property
    def computed(self) -> tuple[float, str]:
        """Target 2's figure and where it came from ("workers" or "requests")."""
        if self.worker_computed is not None:
            return self.worker_computed, "workers"
        return float(self.computed_tokens), "requests"

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _p50(values: list[float]) -> float | None:
    return percentile(values, 50.0) if values else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _kv_bytes(records: list[RequestRecord]) -> list[float]:
    return [float(r.kv_transfer_bytes) for r in records if r.kv_transfer_bytes is not None]


def _sum_all(values: list[float | None]) -> float | None:
    return None if not values or None in values else sum(v for v in values if v is not None)


def figures(
    policy: str,
    workload: str,
    result: BenchResult,
    workers: Mapping[str, WorkerCounters],
    layout: KvLayout,
) -> RunFigures:
    """``result``'s figures; ``workers``: each worker's counter growth over the workload."""
    ok = [r for r in result.records if r.ok]
    later = [r for r in ok if r.turn]

    def ttfts(rs: list[RequestRecord]) -> list[float]:
        return [t * MS for r in rs if (t := ttft(r)) is not None]

    checks = bytes_checks(result, layout)
    gaps = [g * MS for r in ok for g in itls(r)]
    return RunFigures(
        policy=policy,
        workload=workload,
        requests=len(result.records),
        failed=len(result.records) - len(ok),
        ttft_p50_ms=_p50(ttfts(ok)),
        later_ttft_p50_ms=_p50(ttfts(later)),
        e2e_p50_ms=_p50([e2e(r) * MS for r in ok]),
        itl_p50_ms=_p50(gaps),
        itl_p99_ms=percentile(gaps, 99.0) if gaps else None,
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        computed_tokens=sum(r.prompt_tokens - (r.cached_tokens or 0) for r in ok),
        cached_tokens=sum(r.cached_tokens or 0 for r in ok),
        worker_computed=_sum_all([w.computed for w in workers.values()]),
        kv_bytes_mean=_mean(_kv_bytes(ok)),
        later_kv_bytes_mean=_mean(_kv_bytes(later)),
        bytes_ok=sum(c.ok is True for c in checks),
        bytes_checked=len(checks),
        bytes_unknown=sum(c.ok is None for c in checks),
    )


@dataclass(frozen=True)
class Target:
    """``name``: what is promised; ``detail``: the figures behind the verdict; ``passed``:
    ``None`` when it could not be judged."""

    name: str
    detail: str
    passed: bool | None


def _at_most(
    name: str, cand: float | None, base: float | None, unit: str, bound: float = HALF
) -> Target:
    r = ratio(cand, base)
    if cand is None or base is None or r is None:
        return Target(name, "not measured", None)
    return Target(name, f"{cand:,.0f} vs {base:,.0f} {unit} ({r:.2f}x)", r <= bound)


def targets(runs: Sequence[RunFigures]) -> list[Target]:
    """The targets of the module docstring for every workload in ``runs``."""
    by = {(f.policy, f.workload): f for f in runs}
    out = []
    for workload in dict.fromkeys(f.workload for f in runs):
        # long-document measures the KV store: the same routing with and without it
        store = workload == "long-document"
        cand_name, base_name = (STORE_CANDIDATE, STORE_BASELINE) if store else (CANDIDATE, BASELINE)
        bound, part = (THIRD, "1/3") if store else (HALF, "1/2")
        cand, base = by.get((cand_name, workload)), by.get((base_name, workload))
        out.append(_at_most(
            f"{workload}: {cand_name} TTFT P50 <= {part} of {base_name}'s",
            cand.ttft_p50_ms if cand else None, base.ttft_p50_ms if base else None, "ms", bound,
        ))  # fmt: skip
        cc, bc = (cand.computed if cand else None), (base.computed if base else None)
        source = " and ".join(sorted({x[1] for x in (cc, bc) if x}))
        out.append(_at_most(
            f"{workload}: {cand_name} prompt tokens computed <= {part} of {base_name}'s",
            cc[0] if cc else None, bc[0] if bc else None, f"tokens ({source})", bound,
        ))  # fmt: skip
        if workload == "multi-turn":
            out.append(_bytes_target(cand))
    return out


def _bytes_target(cand: RunFigures | None) -> Target:
    name = f"multi-turn: {CANDIDATE} KV bytes of every later turn <= its new tokens' + 1 block"
    if cand is None or cand.bytes_checked == 0:
        return Target(name, "not measured", None)
    detail = f"{cand.bytes_ok}/{cand.bytes_checked} later turns within"
    if cand.bytes_unknown:
        return Target(name, f"{detail}, {cand.bytes_unknown} did not report bytes", None)
    return Target(name, detail, cand.bytes_ok == cand.bytes_checked)

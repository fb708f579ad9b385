"""The workers' own prefix-cache and KV-transfer counters, read around each workload.

Per worker, summed over label sets (docs/api.md, "Worker metrics"):
``pdserve:prompt_tokens_cached_total`` (prompt tokens whose KV it already held; a decode
worker counts what it did not need sent), ``pdserve:prompt_tokens_computed_total`` (prompt
tokens it computed) and ``pdserve:kv_transfer_bytes_total`` (a prefill worker's bytes
written, a decode worker's received). A counter a worker does not export is ``None``.
Parsing and differences are pure; ``read_counters`` does the I/O.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass

from bench._common import ratio
from bench.chaos.probes import samples

CACHED = "pdserve:prompt_tokens_cached_total"
COMPUTED = "pdserve:prompt_tokens_computed_total"
KV_BYTES = "pdserve:kv_transfer_bytes_total"
SCRAPE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class WorkerCounters:
    """One worker's counters (or their growth over a workload)."""

    worker: str
    cached: float | None
    computed: float | None
    kv_bytes: float | None

    @property
    def role(self) -> str:
        return self.worker.rsplit("-", 1)[0]

    @property
    def hit_rate(self) -> float | None:
        """cached / (cached + computed), where both are known."""
        if self.cached is None or self.computed is None:
            return None
        return ratio(self.cached, self.cached + self.computed)


def _total(text: str, name: str) -> float | None:
    found = samples(text, name)
    return sum(v for _, v in found) if found else None


def parse_counters(worker: str, text: str) -> WorkerCounters:
    """``worker``'s counters from its Prometheus text."""
    return WorkerCounters(worker, _total(text, CACHED), _total(text, COMPUTED),
                          _total(text, KV_BYTES))  # fmt: skip


def growth(before: WorkerCounters, after: WorkerCounters) -> WorkerCounters:
    """What each counter grew by (``None`` where either reading lacks it)."""

    def diff(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else b - a

    return WorkerCounters(
        after.worker,
        diff(before.cached, after.cached),
        diff(before.computed, after.computed),
        diff(before.kv_bytes, after.kv_bytes),
    )


def read_counters(endpoints: Mapping[str, str]) -> dict[str, WorkerCounters]:
    """Every worker's counters from ``launch``'s ``metrics:<worker>`` URLs; a worker whose
    metrics do not answer in time reads as all ``None``."""
    out = {}
    for key, url in sorted(endpoints.items()):
        if not key.startswith("metrics:"):
            continue
        worker = key.split(":", 1)[1]
        try:
            with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as r:
                out[worker] = parse_counters(worker, r.read().decode())
        except OSError:
            out[worker] = WorkerCounters(worker, None, None, None)
    return out

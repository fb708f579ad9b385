"""Prefix reuse as the client saw it (pure): cached vs computed prompt tokens, KV bytes moved
per request, and both per worker.

Per successful request: ``cached_tokens`` (the server's ``usage.prompt_tokens_details``:
prompt tokens not computed for it), computed = prompt - cached, and pdserve's
``kv_transfer_bytes``. A request belongs to the worker that computed its prompt: its prefill
worker, or its decode worker when that prefilled it itself; ``"?"`` when the server did not
say (not pdserve). A worker's hit rate = its requests' cached / prompt tokens. Requests whose
server reported no cached count are left out of the token sums (``unreported`` counts them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from bench._common import markdown_table, mib_cell, percent_cell, ratio
from bench.serve.metrics import Stats, stats
from bench.serve.result import BenchResult, RequestRecord

UNKNOWN_WORKER = "?"


@dataclass(frozen=True)
class Reuse:
    """Token and KV sums of a set of requests (all of a tag, or one worker's)."""

    requests: int
    prompt_tokens: int
    cached_tokens: int
    kv_transfer_bytes: int

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def hit_rate(self) -> float | None:
        return ratio(self.cached_tokens, self.prompt_tokens)

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "computed_tokens": self.computed_tokens, "hit_rate": self.hit_rate}


@dataclass(frozen=True)
class ReuseSummary:
    """The reuse of the requests of ``tag`` (``None``: all) in one run: ``total``, the KV
    bytes per request (those that reported it), and ``workers`` (name -> ``Reuse``, sorted)."""

    tag: str | None
    total: Reuse
    unreported: int
    kv_bytes: Stats
    workers: dict[str, Reuse]

    def to_dict(self) -> dict[str, object]:
        return {
            "tag": self.tag,
            "total": self.total.to_dict(),
            "unreported": self.unreported,
            "kv_bytes": asdict(self.kv_bytes),
            "workers": {name: w.to_dict() for name, w in self.workers.items()},
        }


def prefilled_by(r: RequestRecord) -> str:
    """The worker that computed ``r``'s prompt (module docstring)."""
    return r.prefill_worker_id or r.decode_worker_id or UNKNOWN_WORKER


def _sum(records: list[RequestRecord]) -> Reuse:
    return Reuse(
        requests=len(records),
        prompt_tokens=sum(r.prompt_tokens for r in records),
        cached_tokens=sum(r.cached_tokens or 0 for r in records),
        kv_transfer_bytes=sum(r.kv_transfer_bytes or 0 for r in records),
    )


def summarize_reuse(result: BenchResult, tag: str | None = None) -> ReuseSummary:
    """The reuse of ``result``'s successful requests of ``tag`` (all when ``None``)."""
    ok = [r for r in result.records if r.ok and (tag is None or r.tag == tag)]
    reported = [r for r in ok if r.cached_tokens is not None]
    by_worker: dict[str, list[RequestRecord]] = {}
    for r in reported:
        by_worker.setdefault(prefilled_by(r), []).append(r)
    return ReuseSummary(
        tag=tag,
        total=_sum(reported),
        unreported=len(ok) - len(reported),
        kv_bytes=stats([float(r.kv_transfer_bytes) for r in ok if r.kv_transfer_bytes is not None]),
        workers={w: _sum(rs) for w, rs in sorted(by_worker.items())},
    )


def summarize_reuse_by_tag(result: BenchResult) -> dict[str, ReuseSummary]:
    """``{"all": overall, <tag>: ...}``; tags only when there are two or more."""
    out = {"all": summarize_reuse(result)}
    tags = result.tags()
    if len(tags) > 1:
        out.update({t: summarize_reuse(result, t) for t in tags})
    return out


REUSE_HEADER = (
    "tag", "requests", "prompt tok", "cached tok", "computed tok", "hit rate",
    "KV MiB/req p50", "KV MiB/req mean", "KV MiB/req max",
)  # fmt: skip
WORKER_HEADER = ("prefilled by", "requests", "prompt tok", "cached tok", "computed tok",
                 "hit rate", "KV MiB moved")  # fmt: skip


def reuse_table(summaries: Mapping[str, ReuseSummary]) -> str:
    """One markdown row per summary, keyed by the name shown in the ``tag`` column."""
    rows = []
    for name, s in summaries.items():
        t = s.total
        rows.append([
            name, str(t.requests), str(t.prompt_tokens), str(t.cached_tokens),
            str(t.computed_tokens), percent_cell(t.hit_rate), mib_cell(s.kv_bytes.p50),
            mib_cell(s.kv_bytes.mean), mib_cell(s.kv_bytes.max),
        ])  # fmt: skip
    return markdown_table(REUSE_HEADER, rows)


def worker_table(summary: ReuseSummary) -> str:
    """One markdown row per worker of ``summary``."""
    rows = [
        [name, str(w.requests), str(w.prompt_tokens), str(w.cached_tokens),
         str(w.computed_tokens), percent_cell(w.hit_rate), mib_cell(w.kv_transfer_bytes)]
        for name, w in summary.workers.items()
    ]  # fmt: skip
    return markdown_table(WORKER_HEADER, rows)

"""What a benchmark run measured: one ``RequestRecord`` per request, in a ``BenchResult``.

Every time is ``time.perf_counter()`` seconds relative to the run's start (t=0 when the
first request may be sent). ``to_dict`` / ``from_dict`` round-trip through JSON.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it.

    ``token_times_s``: arrival time of every streamed chunk that carried text (one token
    event each). ``completion_tokens``: the server's ``usage`` count when it sent one,
    otherwise ``len(token_times_s)``; it may exceed the number of events when a chunk held
    several tokens (the event times are kept as they came). ``prompt_tokens``: from
    ``usage``, otherwise the length that was sent. ``status``: the HTTP status (0 when no
    response arrived). ``error``: why the request failed (``None``: it succeeded).

    Prefix reuse, where the server says (``None`` where it did not): ``cached_tokens``
    (``usage.prompt_tokens_details.cached_tokens``: prompt tokens not computed for this
    request) and, from pdserve's ``"pdserve"`` response object, ``kv_transfer_bytes``,
    ``prefill_worker_id`` and ``decode_worker_id`` (docs/api.md). Conversations: ``session``
    and ``turn`` (0-based) of the request, and ``output_text``, the answer the next turn
    sends back.
    """

    index: int
    tag: str
    send_s: float
    end_s: float
    token_times_s: tuple[float, ...]
    prompt_tokens: int
    completion_tokens: int
    output_tokens_asked: int
    status: int
    error: str | None = None
    scheduled_s: float | None = None
    finish_reason: str | None = None
    cached_tokens: int | None = None
    kv_transfer_bytes: int | None = None
    prefill_worker_id: str | None = None
    decode_worker_id: str | None = None
    session: int | None = None
    turn: int | None = None
    output_text: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["token_times_s"] = list(self.token_times_s)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        return cls(**{**d, "token_times_s": tuple(d["token_times_s"])})


@dataclass(frozen=True)
class BenchResult:
    """A run: its records (by request index), duration and configuration.

    ``duration_s`` runs from the start (t=0) to the end of the last request.
    ``started_at``: the wall-clock time (``time.time()``) of t=0. ``config``: JSON-ready
    settings of the run (endpoint, model, arrival, workload ...).
    """

    records: tuple[RequestRecord, ...]
    duration_s: float
    started_at: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)

    def tags(self) -> list[str]:
        """The tags present, in order of first appearance."""
        return list(dict.fromkeys(r.tag for r in self.records))

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "started_at": self.started_at,
            "duration_s": self.duration_s,
            "records": [r.to_dict() for r in self.records],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchResult:
        """Inverse of ``to_dict``; extra keys (e.g. the CLI's ``summaries``) are ignored."""
        return cls(
            records=tuple(RequestRecord.from_dict(r) for r in d["records"]),
            duration_s=float(d["duration_s"]),
            started_at=float(d.get("started_at", 0.0)),
            config=dict(d.get("config", {})),
        )

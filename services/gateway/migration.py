"""When a broken decode stream moves to another placement, and when it stops: pure policy.

A broken attempt is classified by its status code and by whether the decode worker named a
prefill worker at fault (``FAILED_WORKER_KEY`` in the trailing metadata):

1. INVALID_ARGUMENT or OUT_OF_RANGE, from either worker: the request is at fault; it is
   not moved (the client gets a 4xx).
2. The decode stream broke with UNAVAILABLE, ABORTED or CANCELLED (the server side
   cancelled; the gateway cancels only on close): the decode worker was lost (it died,
   drained, or its host went silent): ``decode_lost``.
3. The decode worker answered INTERNAL or UNKNOWN: it is alive but failed running this
   request: ``decode_failed``.
4. The prefill failed with UNAVAILABLE, ABORTED, CANCELLED or RESOURCE_EXHAUSTED: the
   prefill worker was lost or full: ``prefill_lost``; with any other code (INTERNAL,
   UNKNOWN, DEADLINE_EXCEEDED, PERMISSION_DENIED, ...): ``prefill_failed``.
5. Any other code (the attempt's own deadline, RESOURCE_EXHAUSTED of the decode worker):
   not moved.

A lost worker is the fleet's fault and the request moves, at most ``max_migrations`` times.
A failure (``*_failed``) may be the request's own: a prompt that always breaks a worker or
always outlasts the prefill deadline. It moves once; the same failure (cause and code) a
second time ends the request with an error saying so, instead of holding decode blocks on
one worker after another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

_LOST = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED})
_DECODE_FAILED = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
_REQUEST_AT_FAULT = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE})


@dataclass(frozen=True)
class Breakage:
    """One attempt's failure that another placement may not repeat."""

    cause: str
    """``decode_lost`` | ``decode_failed`` | ``prefill_lost`` | ``prefill_failed``."""
    worker_id: str
    """The worker at fault: excluded from the next placement."""
    code: grpc.StatusCode
    details: str

    @property
    def worker_lost(self) -> bool:
        return self.cause.endswith("_lost")

    def __str__(self) -> str:
        return f"{self.cause} on {self.worker_id}: {self.code.name}: {self.details}"


def classify(
    code: grpc.StatusCode, details: str, decode_worker_id: str, failed_prefill_worker: str | None
) -> Breakage | None:
    """The breakage of an attempt that ended with ``code`` (None: do not move it, rules 1
    and 5). ``failed_prefill_worker``: the prefill worker the decode worker blamed."""
    if code in _REQUEST_AT_FAULT:
        return None
    if failed_prefill_worker:
        lost = code in _LOST or code == grpc.StatusCode.RESOURCE_EXHAUSTED
        cause = "prefill_lost" if lost else "prefill_failed"
        return Breakage(cause, failed_prefill_worker, code, details)
    if code in _LOST:
        return Breakage("decode_lost", decode_worker_id, code, details)
    if code in _DECODE_FAILED:
        return Breakage("decode_failed", decode_worker_id, code, details)
    return None


@dataclass
class MigrationHistory:
    """The breakages one request met so far; says whether the next one moves it."""

    max_migrations: int
    breakages: list[Breakage] = field(default_factory=list)

    def give_up(self, b: Breakage) -> str | None:
        """Record ``b``; None when the request moves again, else why it stops."""
        repeated = not b.worker_lost and any(
            (p.cause, p.code) == (b.cause, b.code) for p in self.breakages
        )
        moved = len(self.breakages)
        self.breakages.append(b)
        if repeated:
            workers = ", ".join(p.worker_id for p in self.breakages if p.cause == b.cause)
            return (
                f"the request failed the same way on two workers ({b.cause} "
                f"{b.code.name} on {workers}), so it is not tried again: {b.details}"
            )
        if moved == self.max_migrations:
            return f"gave up after {moved} migrations; last: {b}"
        return None

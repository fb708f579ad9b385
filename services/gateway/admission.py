"""Admission at the gateway: who may start a generation now, for every backend and both edges.

Lifecycle of a request here: rate check (its key's token bucket) -> admitted at once (a free
slot, nobody waiting) | queued (the wait queue has room; FIFO, at most ``queue_timeout_s``)
| refused -> holds a slot while it tokenizes and streams -> released (a queued request takes
the slot over). Refusals are errors the edges already map: ``Overloaded`` and
``RateLimited`` (``ResourceExhaustedError``: HTTP 429 with ``Retry-After``, gRPC
RESOURCE_EXHAUSTED with ``retry-after-ms``), and ``BackendUnavailableError`` while draining
(503 / UNAVAILABLE; queued requests get it too).

The cap follows the fleet unless it was given (``follow_fleet``): every placement tells the
fleet's target batch (what the decode workers run at once within their ITL targets, summed:
``services/scheduler/policy.py``), and ``follow`` makes it the cap, so the fleet fills every
decode worker to its target and the excess waits here, first come first served, for at
most ``queue_timeout_s``, or is refused at once when the queue is full, instead of being
placed on a full worker and refused there. Until the first placement the cap is the
configured start. A larger cap hands its new slots to the longest waiters at once; a
smaller one takes effect as slots are released (nothing running is cut). The queue's bound
stays as configured: a burst larger than the fleet's batches waits for their slots (within
its deadline) rather than being refused.

``decide`` and ``take_token`` are the policy (pure); ``Admission`` owns the state (slots, the
queue, the buckets) and is touched only from the event loop, so it needs no lock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from engine.errors import ResourceExhaustedError
from services.gateway.backend import BackendUnavailableError

# Buckets of keys idle long enough to be full again carry no state: dropped past this many.
_MAX_BUCKETS = 10_000


class Overloaded(ResourceExhaustedError):
    """Every slot is taken and the wait queue is full (or the wait timed out)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RateLimited(ResourceExhaustedError):
    """The caller's key started more requests than its rate allows."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class AdmissionLimits:
    """``max_concurrent``: generations at once (the start, with ``follow_fleet``: then the
    fleet's target batch). ``max_queued``: requests that may wait for a slot, each at most
    ``queue_timeout_s``. ``rate_per_key``: requests a second each key may start, with
    bursts of ``burst`` (0: no rate limit). ``retry_after_s``: the back-off a refusal
    suggests when nothing better is known."""

    max_concurrent: int
    max_queued: int = 0
    queue_timeout_s: float = 10.0
    rate_per_key: float = 0.0
    burst: int = 1
    retry_after_s: float = 1.0
    follow_fleet: bool = False

    def __post_init__(self) -> None:
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent={self.max_concurrent} must be >= 1")
        if self.max_queued < 0:
            raise ValueError(f"max_queued={self.max_queued} must be >= 0")
        if not self.queue_timeout_s > 0:
            raise ValueError(f"queue_timeout_s={self.queue_timeout_s} must be > 0")
        if self.rate_per_key < 0:
            raise ValueError(f"rate_per_key={self.rate_per_key} must be >= 0")
        if self.burst < 1:
            raise ValueError(f"burst={self.burst} must be >= 1")


class Decision(enum.Enum):
    ADMIT = "admit"
    QUEUE = "queue"
    REFUSE = "refuse"


def decide(limits: AdmissionLimits, in_flight: int, queued: int) -> Decision:
    """Admit when a slot is free and nobody waits ahead (FIFO), queue while the queue has
    room, else refuse."""
    if in_flight < limits.max_concurrent and queued == 0:
        return Decision.ADMIT
    if queued < limits.max_queued:
        return Decision.QUEUE
    return Decision.REFUSE


@dataclass(frozen=True)
class Bucket:
    """A token bucket: ``tokens`` left at time ``at`` (monotonic seconds)."""

    tokens: float
    at: float


def take_token(bucket: Bucket | None, now: float, rate: float, burst: int) -> tuple[Bucket, float]:
    """Take one request's token from ``bucket`` (None: a new key, full), refilled at ``rate``
    a second up to ``burst``. Returns the bucket after and 0.0, or, with no whole token
    there, the refilled bucket and the seconds until one is."""
    if bucket is None:
        tokens = float(burst)
    else:
        tokens = min(float(burst), bucket.tokens + (now - bucket.at) * rate)
    if tokens >= 1.0:
        return Bucket(tokens - 1.0, now), 0.0
    return Bucket(tokens, now), (1.0 - tokens) / rate


class Admission:
    """The gateway's slots, wait queue and per-key rate buckets.

    ``slot(key)`` is the one way in: an async context manager that raises ``Overloaded``,
    ``RateLimited`` or ``BackendUnavailableError`` (draining), and otherwise holds a slot
    until it exits.
    """

    def __init__(
        self,
        limits: AdmissionLimits,
        *,
        on_refused: Callable[[str], None] = lambda reason: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self._on_refused = on_refused  # reason: overloaded, rate_limited or draining
        self._clock = clock
        self._in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._buckets: dict[str, Bucket] = {}
        self._draining = False

    @property
    def in_flight(self) -> int:
        """Requests holding a slot."""
        return self._in_flight

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return sum(1 for w in self._waiters if not w.done())

    def follow(self, fleet_target_batch: int) -> None:
        """Take the fleet's target batch as the cap, when this admission follows the fleet
        (``AdmissionLimits.follow_fleet``) and it is known (> 0); module docstring."""
        limits = self.limits
        if not limits.follow_fleet or fleet_target_batch < 1:
            return
        if fleet_target_batch != limits.max_concurrent:
            self.limits = dataclasses.replace(limits, max_concurrent=fleet_target_batch)
            self._hand_over()

    def start_draining(self) -> None:
        """Refuse everything from now on; requests waiting in the queue are refused too."""
        self._draining = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(_draining())

    @asynccontextmanager
    async def slot(self, key: str, count: int = 1) -> AsyncIterator[None]:
        """Hold ``count`` slots for the body (a request of ``count`` choices: one rate
        token, one slot per generation, taken one after another in the queue's order); see
        the class docstring for what it raises."""
        held = 0
        try:
            for i in range(count):
                await self._acquire(key if i == 0 else None)
                held += 1
            yield
        finally:
            for _ in range(held):
                self._release()

    async def _acquire(self, key: str | None) -> None:
        try:
            await self._wait_for_slot(key)
        except Overloaded:
            self._on_refused("overloaded")
            raise
        except RateLimited:
            self._on_refused("rate_limited")
            raise
        except BackendUnavailableError:
            self._on_refused("draining")
            raise

    async def _wait_for_slot(self, key: str | None) -> None:
        if self._draining:
            raise _draining()
        if key is not None:  # None: another slot of a request already counted
            self._check_rate(key)
        self._waiters = deque(w for w in self._waiters if not w.done())
        decision = decide(self.limits, self._in_flight, len(self._waiters))
        if decision is Decision.ADMIT:
            self._in_flight += 1
            return
        limits = self.limits
        if decision is Decision.REFUSE:
            raise Overloaded(
                f"the server is at its limit of {limits.max_concurrent} concurrent requests "
                f"and {limits.max_queued} waiting; retry later",
                limits.retry_after_s,
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(limits.queue_timeout_s):
                await waiter  # _release hands its slot over: in_flight already counts us
        except TimeoutError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                return  # the slot came as the timer fired: keep it
            raise Overloaded(
                f"no slot freed within {limits.queue_timeout_s:g} s (the server is at its "
                f"limit of {limits.max_concurrent} concurrent requests); retry later",
                limits.retry_after_s,
            ) from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._release()  # handed over just as the caller left: pass it on
            raise

    def _release(self) -> None:
        self._in_flight -= 1
        self._hand_over()

    def _hand_over(self) -> None:
        """Give free slots to the longest waiters (a waiter counts as in flight once woken)."""
        while self._waiters and self._in_flight < self.limits.max_concurrent:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._in_flight += 1
                waiter.set_result(None)

    def _check_rate(self, key: str) -> None:
        rate = self.limits.rate_per_key
        if rate <= 0:
            return
        now = self._clock()
        bucket, wait_s = take_token(self._buckets.get(key), now, rate, self.limits.burst)
        self._buckets[key] = bucket
        if len(self._buckets) > _MAX_BUCKETS:
            self._forget_full_buckets(now)
        if wait_s > 0:
            raise RateLimited(
                f"rate limit of {rate:g} requests/s (bursts of {self.limits.burst}) reached for "
                f"this API key; retry in {wait_s:.2f} s",
                wait_s,
            )

    def _forget_full_buckets(self, now: float) -> None:
        full_after = self.limits.burst / self.limits.rate_per_key
        self._buckets = {k: b for k, b in self._buckets.items() if now - b.at < full_after}


def _draining() -> BackendUnavailableError:
    return BackendUnavailableError("the gateway is shutting down; retry on another replica")


def retry_after_s(exc: Exception, default: float = 1.0) -> float:
    """The back-off ``exc`` suggests (``Overloaded`` / ``RateLimited`` know theirs)."""
    value = getattr(exc, "retry_after_s", None)
    return value if isinstance(value, float | int) and value > 0 else default


def retry_after_header(seconds: float) -> str:
    """HTTP ``Retry-After`` is whole seconds: round up, at least 1."""
    return str(max(1, math.ceil(seconds)))

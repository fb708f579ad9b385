"""The gateway's Prometheus metrics (vLLM's names, ``pdserve:`` prefix).

One ``GatewayMetrics`` per process, shared by the HTTP and gRPC edges, each with its own
registry so several gateways (tests) can live in one interpreter.

- ``pdserve:requests_total{endpoint,status}``: finished calls by edge endpoint and outcome
  (HTTP status code, or gRPC status name).
- ``pdserve:request_success_total{finished_reason}``: generations that ran to a finish.
- ``pdserve:prompt_tokens_total``, ``pdserve:generation_tokens_total``.
- ``pdserve:time_to_first_token_seconds``: request received -> first token out of the backend.
- ``pdserve:inter_token_latency_seconds``: gap between consecutive tokens of one request.
- ``pdserve:e2e_request_latency_seconds``: request received -> last chunk.
- ``pdserve:num_requests_running``: generations streaming now.
- ``pdserve:migrations_total{cause}``: requests placed again after a broken stream (cluster).
- ``pdserve:request_goodput_total``: requests that met the latency SLO (``LatencySlo``).
- ``pdserve:num_requests_waiting``: requests in the admission queue (``admission``).
- ``pdserve:max_concurrent_requests``: the admission's cap now (it follows the fleet's
  target batch unless given).
- ``pdserve:requests_refused_total{reason}``: requests turned away at the edge: overloaded,
  rate_limited, draining, too_long (refused before tokenizing), slow_reader (stream cut
  after the write timeout), connections (over the connection cap).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from services.gateway.backend import GenerateChunk

REFUSAL_REASONS = (
    "overloaded", "rate_limited", "draining", "too_long", "slow_reader", "connections",
)  # fmt: skip
# vLLM's buckets: sub-10 ms to minutes for first tokens, 10 ms steps near typical ITL.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


@dataclass(frozen=True)
class LatencySlo:
    """The bounds a request must meet to count as good (``pdserve bench``'s goodput rule).

    Good: it finished by ``stop`` or ``length``, its TTFT <= ``ttft_s`` and every one of its
    inter-token gaps <= ``itl_s`` (one stall is enough to break it). A bound left None is not
    checked, so with neither set every request that finished so counts.
    """

    ttft_s: float | None = None
    itl_s: float | None = None

    @classmethod
    def from_ms(cls, ttft_ms: float | None, itl_ms: float | None) -> LatencySlo:
        return cls(*(None if ms is None else ms / 1000 for ms in (ttft_ms, itl_ms)))

    def met(self, finish_reason: str, ttft_s: float | None, max_itl_s: float) -> bool:
        if finish_reason not in ("stop", "length"):
            return False
        if self.ttft_s is not None and (ttft_s is None or ttft_s > self.ttft_s):
            return False
        return self.itl_s is None or max_itl_s <= self.itl_s


_GOODPUT_HELP = (
    "Requests that finished (stop or length) with TTFT and every inter-token gap within the "
    "gateway's --slo-ttft-ms and --slo-itl-ms (a bound not set is not checked)."
)
_MIGRATIONS_HELP = (
    "Requests placed again after their stream broke, by cause: decode_lost (the decode worker "
    "died or went away), decode_failed (it failed running the request), prefill_lost (the "
    "prefill worker or its transfer went away) or prefill_failed (it failed the request: an "
    "error, a deadline)."
)
_MIGRATION_CAUSES = ("decode_lost", "decode_failed", "prefill_lost", "prefill_failed")


class _Series:
    """Makes the metric objects of one registry (the table in ``GatewayMetrics``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)


class GatewayMetrics:
    """The metric objects, and ``track`` to measure one generation stream."""

    def __init__(self, model_name: str, slo: LatencySlo = LatencySlo()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.slo = slo
        new = _Series(self.registry)
        self.requests = new.counter(
            "pdserve:requests", "Finished gateway calls.", "endpoint", "status"
        )
        self.request_success = new.counter(
            "pdserve:request_success",
            "Generations that finished, by finish reason.",
            "model_name",
            "finished_reason",
        )
        self.prompt_tokens = new.counter(
            "pdserve:prompt_tokens", "Prompt tokens processed.", "model_name"
        )
        self.generation_tokens = new.counter(
            "pdserve:generation_tokens", "Tokens generated.", "model_name"
        )
        self.ttft = new.histogram(
            "pdserve:time_to_first_token_seconds", "Request received to first token.", _TTFT_BUCKETS
        )
        self.itl = new.histogram(
            "pdserve:inter_token_latency_seconds",
            "Time between consecutive tokens of one request.",
            _ITL_BUCKETS,
        )
        self.e2e = new.histogram(
            "pdserve:e2e_request_latency_seconds", "Request received to last token.", _E2E_BUCKETS
        )
        self.running = new.gauge(
            "pdserve:num_requests_running", "Generations streaming now.", "model_name"
        )
        # Counted per request here because the histograms cannot say it: a request is good
        # only if TTFT and *all* its gaps meet the SLO, a joint condition buckets lose.
        self.goodput = new.counter("pdserve:request_goodput", _GOODPUT_HELP, "model_name")
        self.migrations = new.counter("pdserve:migrations", _MIGRATIONS_HELP, "cause")
        self.waiting = new.gauge(
            "pdserve:num_requests_waiting", "Requests waiting for an admission slot."
        )
        self.concurrency = new.gauge(
            "pdserve:max_concurrent_requests",
            "Generations admitted at once now: --max-concurrent-requests, or what the decode "
            "workers run within their ITL targets, summed (admission).",
        )
        self.refused = new.counter(
            "pdserve:requests_refused",
            "Requests turned away at the edge, by reason (see the gateway's docs).",
            "reason",
        )
        self._export_zeros()

    def _export_zeros(self) -> None:
        """Export the series a dashboard divides by at 0 from the start: a series born at
        its first increment hides that increment from rate(), which would put goodput above
        the finished requests."""
        self.goodput.labels(self.model_name)
        for reason in ("stop", "length"):
            self.request_success.labels(self.model_name, reason)
        for cause in _MIGRATION_CAUSES:
            self.migrations.labels(cause)
        for reason in REFUSAL_REASONS:
            self.refused.labels(reason)

    def count_refusal(self, reason: str) -> None:
        self.refused.labels(reason).inc()

    def count_migration(self, cause: str) -> None:
        self.migrations.labels(cause).inc()

    def count_request(self, endpoint: str, status: str | int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    async def track(
        self, stream: AsyncIterator[GenerateChunk], received_at: float, model_name: str
    ) -> AsyncIterator[GenerateChunk]:
        """Yield ``stream``'s chunks while timing them; closing this closes ``stream``.

        ``received_at`` is the ``time.monotonic()`` when the edge received the request.
        """
        running = self.running.labels(model_name)
        running.inc()
        last: float | None = None
        ttft: float | None = None
        max_gap = 0.0
        try:
            async with aclosing(stream):  # type: ignore[type-var]
                async for chunk in stream:
                    now = time.monotonic()
                    n = len(chunk.token_ids)
                    if n:
                        if last is None:
                            ttft = now - received_at
                            self.ttft.labels(model_name).observe(ttft)
                        else:
                            # A chunk may carry several tokens: spread the gap over them.
                            gap = (now - last) / n
                            max_gap = max(max_gap, gap)
                            for _ in range(n):
                                self.itl.labels(model_name).observe(gap)
                        last = now
                    if chunk.finish_reason is not None:
                        # Recorded before yielding: consumers stop at the last chunk.
                        self._finished(chunk, now - received_at, model_name)
                        if self.slo.met(chunk.finish_reason, ttft, max_gap):
                            self.goodput.labels(model_name).inc()
                    yield chunk
        finally:
            running.dec()

    def _finished(self, chunk: GenerateChunk, seconds: float, model_name: str) -> None:
        self.e2e.labels(model_name).observe(seconds)
        self.request_success.labels(model_name, chunk.finish_reason).inc()
        self.prompt_tokens.labels(model_name).inc(chunk.prompt_tokens)
        self.generation_tokens.labels(model_name).inc(chunk.completion_tokens)

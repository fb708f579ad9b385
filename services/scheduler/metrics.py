"""The scheduler's Prometheus instruments, on a registry of their own.

Only the state loop and the servicer update them; the /metrics HTTP thread only reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.scheduler.model import PrefillMode, RejectReason, Role


class SchedulerMetrics:
    """Gauges of live workers and queue depths; counters of placements and rejections."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.workers = Gauge(
            "pdserve_scheduler_workers", "Registered workers by role", ["role"], registry=r
        )
        self.placements = Counter(
            "pdserve_scheduler_placements",
            "Requests placed, by who prefills",
            ["prefill_mode"],
            registry=r,
        )
        self.rejections = Counter(
            "pdserve_scheduler_rejections", "Requests refused, by reason", ["reason"], registry=r
        )
        self.expired_workers = Counter(
            "pdserve_scheduler_expired_workers",
            "Workers dropped because their heartbeat lease lapsed",
            registry=r,
        )
        self.queue_depth = Gauge(
            "pdserve_scheduler_queue_depth", "Commands waiting for the state loop", registry=r
        )
        self.store_pending = Gauge(
            "pdserve_scheduler_redis_pending_writes", "Redis writes queued", registry=r
        )
        self.store_dropped = Gauge(
            "pdserve_scheduler_redis_dropped_writes",
            "Redis writes dropped (queue full or retries exhausted) since start",
            registry=r,
        )
        self.redis_up = Gauge(
            "pdserve_scheduler_redis_up",
            "1 while the last Redis probe answered, else 0",
            registry=r,
        )
        self.redis_remirrors = Counter(
            "pdserve_scheduler_redis_remirrors",
            "Times the registry and prefix index were written to Redis again (after Redis "
            "restarted or came back)",
            registry=r,
        )
        self.kv_events = Counter(
            "pdserve_scheduler_kv_events",
            "Block hashes the workers' KV events added to or removed from the prefix index "
            "(a snapshot counts the changes it made), and snapshots received",
            ["kind"],
            registry=r,
        )
        self.prefix_blocks = Gauge(
            "pdserve_scheduler_prefix_index_blocks",
            "Distinct block hashes some live worker caches",
            registry=r,
        )
        self.cache_hit_tokens = Counter(
            "pdserve_scheduler_expected_cached_tokens",
            "Prompt tokens placements expected the chosen worker to find cached",
            registry=r,
        )
        self.place_seconds = Histogram(
            "pdserve_scheduler_place_seconds",
            "Place RPC latency inside the scheduler",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0),
            registry=r,
        )
        for role in Role:
            self.workers.labels(role.value)
        for mode in PrefillMode:
            self.placements.labels(mode.value)
        for reason in RejectReason:
            self.rejections.labels(reason.value)
        for kind in ("added", "removed", "snapshot"):
            self.kv_events.labels(kind)

    def set_workers(self, by_role: Mapping[Role, int]) -> None:
        """Set the worker gauges (every role, zero when absent)."""
        for role in Role:
            self.workers.labels(role.value).set(by_role.get(role, 0))

    def watch(
        self,
        queue_depth: Callable[[], int],
        store_pending: Callable[[], int],
        store_dropped: Callable[[], int],
    ) -> None:
        """Read these gauges from callables at scrape time."""
        self.queue_depth.set_function(queue_depth)
        self.store_pending.set_function(store_pending)
        self.store_dropped.set_function(store_dropped)

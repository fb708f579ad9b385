"""The scheduler's configuration: one frozen dataclass, its flags and its environment
(``PDSERVE_SCHEDULER_*``), through ``services.common.settings``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common import settings
from services.common.cluster_auth import ClusterAuthArgs
from services.common.faults import FaultArgs
from services.common.settings import LOG_LEVELS, log_level, setting
from services.scheduler.model import Routing
from services.scheduler.policy import LOCAL_PREFILL_MAX_TOKENS, AdmissionLimits
from services.scheduler.state import StateConfig

ABOUT = "pdserve scheduler: placement, admission and the worker registry."


@dataclass(frozen=True)
class SchedulerConfig:
    """Everything the scheduler process is told; validated on construction."""

    grpc_host: str = setting("0.0.0.0", "address the gRPC server binds")
    grpc_port: int = setting(50051, "gRPC port (0: pick a free one and log it)")
    metrics_host: str = setting("0.0.0.0", "address the Prometheus /metrics server binds")
    metrics_port: int = setting(9091, "Prometheus /metrics HTTP port (0: no metrics server)")
    redis_url: str = setting(
        "redis://127.0.0.1:6379/0", "Redis URL; empty: run without Redis (no warm restart)"
    )
    redis_username: str = setting(
        "", "Redis ACL user the scheduler logs in as (empty: Redis's default user)"
    )
    redis_password_file: str | None = setting(
        None,
        "file holding the Redis password (or the password itself in "
        "PDSERVE_SCHEDULER_REDIS_PASSWORD); neither: Redis is used without a password, "
        "and anyone who can reach it can rewrite the scheduler's records",
        metavar="PATH",
    )
    redis_password: str | None = setting(None, "the Redis password itself", secret=True)
    redis_key_prefix: str = setting("pdserve", "prefix of every Redis key the scheduler owns")
    redis_timeout_s: float = setting(2.0, "deadline of each Redis call")
    redis_probe_s: float = setting(
        1.0,
        "how often to check that Redis answers and is the same instance; when it comes back "
        "or restarted, the registry and prefix index are written to it again",
    )
    heartbeat_ttl_s: float = setting(
        3.0, "worker lease: a worker is dropped this long after its last heartbeat"
    )
    heartbeats_per_ttl: int = setting(3, "heartbeats a worker sends per lease (interval = ttl / n)")
    queue_size: int = setting(1024, "bound of the state loop's command queue")
    max_inflight: int = setting(4096, "global cap on requests in flight across decode workers")
    max_waiting_per_worker: int = setting(
        64, "sequences a worker may hold beyond its max_num_seqs (queued)"
    )
    max_queued_prompt_tokens: int = setting(65536, "cap on a prefill worker's prompt-token backlog")
    routing: str = setting(
        Routing.CACHE_AWARE.value,
        "how placement chooses among workers with room: cache-aware (the prompt tokens each "
        "would compute, from the prefix index its KV events feed, plus its backlog), "
        "least-loaded or round-robin (both blind to caches; for comparison)",
        choices=[r.value for r in Routing],
    )
    local_prefill_max_tokens: int = setting(
        LOCAL_PREFILL_MAX_TOKENS,
        "a decode worker prefills a request itself when it would compute at most this many "
        "prompt tokens (with cache-aware routing: the prompt minus what it caches; else the "
        "whole prompt); `pdserve plan` prints the limit for a profile and ITL SLO (0: never)",
    )
    request_ttl_s: float = setting(3600.0, "TTL of request records in Redis")
    prefix_ttl_s: float = setting(3600.0, "TTL of prefix-index sets in Redis (renewed on add)")
    store_queue_size: int = setting(8192, "bound of the Redis write-behind queue")
    drain_timeout_s: float = setting(5.0, "on SIGTERM: how long in-flight RPCs may finish")
    placement_token_ttl_s: float = setting(
        600.0, "how long a placement token lets a prefill worker write into the decode worker's KV"
    )
    placement_signing_key_file: str | None = setting(
        None,
        "PEM Ed25519 private key placement tokens are signed with (openssl genpkey -algorithm "
        "ed25519); none: a fresh key per start (workers learn the public key as they register)",
        metavar="PATH",
    )
    log_level: str = setting("info", "log level", parse=log_level, choices=LOG_LEVELS)
    cluster: ClusterAuthArgs = field(default_factory=ClusterAuthArgs)
    fault_args: FaultArgs = field(default_factory=FaultArgs)

    def __post_init__(self) -> None:
        if self.redis_password_file and self.redis_password:
            raise ValueError(
                "give the Redis password one way: --redis-password-file or "
                "PDSERVE_SCHEDULER_REDIS_PASSWORD"
            )
        positive = (
            "heartbeat_ttl_s",
            "heartbeats_per_ttl",
            "queue_size",
            "max_inflight",
            "max_queued_prompt_tokens",
            "request_ttl_s",
            "prefix_ttl_s",
            "store_queue_size",
            "redis_timeout_s",
            "placement_token_ttl_s",
            "redis_probe_s",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("grpc_port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be a port number, got {getattr(self, name)!r}")
        for name in ("max_waiting_per_worker", "local_prefill_max_tokens", "drain_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def heartbeat_interval_ms(self) -> int:
        """How often workers heartbeat: the lease split into ``heartbeats_per_ttl``."""
        return max(1, int(self.heartbeat_ttl_s * 1000 / self.heartbeats_per_ttl))

    def limits(self) -> AdmissionLimits:
        """The admission caps placement applies."""
        return AdmissionLimits(
            max_inflight=self.max_inflight,
            max_waiting_per_worker=self.max_waiting_per_worker,
            max_queued_prompt_tokens=self.max_queued_prompt_tokens,
            local_prefill_max_tokens=self.local_prefill_max_tokens,
            # Loads refresh once per heartbeat: retrying sooner sees the same cluster.
            retry_after_ms=self.heartbeat_interval_ms,
        )

    def state_config(self) -> StateConfig:
        """What the state loop needs."""
        return StateConfig(
            lease_ttl_s=self.heartbeat_ttl_s,
            heartbeat_interval_ms=self.heartbeat_interval_ms,
            queue_size=self.queue_size,
            limits=self.limits(),
            routing=Routing(self.routing),
        )


load_config = settings.loader(SchedulerConfig, "scheduler", "python -m services.scheduler", ABOUT)

"""The gateway's configuration: one frozen dataclass, its flags and its environment
(``PDSERVE_GATEWAY_*``), through ``services.common.settings``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.engine_config import EngineConfig
from services.common import settings
from services.common.cluster_auth import ClusterAuthArgs
from services.common.faults import FaultArgs
from services.common.settings import LOG_LEVELS, log_level, setting
from services.common.tuning import Tuning

ABOUT = "pdserve gateway: OpenAI-compatible HTTP and gRPC Generate."
BACKENDS = ("local", "cluster")


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway process needs. Validated on construction (``ValueError``)."""

    host: str = setting("0.0.0.0", "address to listen on (HTTP and gRPC)")
    http_port: int = setting(8000, "OpenAI-compatible HTTP port (0: any free port)")
    grpc_port: int = setting(50051, "gRPC Gateway port (0: any free port)")
    backend: str = setting(
        "local",
        "where generation runs; 'local': an engine in this process; 'cluster': the scheduler "
        "places each request on prefill/decode workers",
        choices=BACKENDS,
    )
    scheduler: str | None = setting(None, "scheduler gRPC address HOST:PORT (cluster backend)")
    served_model_name: str | None = setting(
        None, "model name clients use (default: the checkpoint's file or directory name)"
    )
    api_keys: tuple[str, ...] = setting(
        (), "comma-separated accepted bearer keys; empty: no authentication"
    )
    max_body_bytes: int = setting(4 << 20, "largest accepted HTTP request body (413 above)")
    default_max_tokens: int = setting(16, "max_tokens when a completion request omits it")
    default_chat_max_tokens: int = setting(
        1024,
        "max_tokens cap when a chat request omits it (the rest of the context, at most this)",
    )
    max_concurrent_requests: int | None = setting(
        None,
        "generations at once, in every backend (tokenizing or streaming); more wait in the "
        "queue (default: what the decode workers run within their ITL targets, summed, as "
        "each placement tells it (the local engine's own, with --backend local); "
        "--max-num-seqs until the first)",
        metavar="N",
    )
    max_queued_requests: int | None = setting(
        None,
        "requests that may wait for a slot (first come, first served); one more gets 429 "
        "with Retry-After / RESOURCE_EXHAUSTED at once (default: as many as "
        "--max-concurrent-requests, or without it --max-num-seqs: a burst of a full batch "
        "waits for the fleet's slots; 0: no queue)",
        metavar="N",
    )
    queue_timeout_s: float = setting(
        30.0,
        "longest wait in the queue; then 429 / RESOURCE_EXHAUSTED (a queue as long as the cap "
        "waits about one request's duration)",
        metavar="SECONDS",
    )
    rate_limit_rps: float = setting(
        0.0,
        "requests a second each API key may start (each client address without --api-keys); "
        "more get 429 with Retry-After (0: no limit)",
        metavar="RATE",
    )
    rate_limit_burst: int = setting(
        10, "requests a key may start at once after being idle (with --rate-limit-rps)"
    )
    write_timeout_s: float = setting(
        30.0,
        "a streaming client must take each write within this, or its stream is cut and its "
        "request cancelled (a client that stops reading frees its slot)",
        metavar="SECONDS",
    )
    max_connections: int = setting(
        512, "open HTTP connections; one more is answered 503 and closed"
    )
    idle_timeout_s: float = setting(
        15.0,
        "an HTTP connection with no request under way (one that has sent nothing, half a "
        "request head, or is idle between requests) is closed after this",
        metavar="SECONDS",
    )
    drain_timeout_s: float = setting(30.0, "on SIGTERM, how long in-flight streams may finish")
    max_migrations: int = setting(
        3,
        "cluster: times one request is placed again after its decode stream broke or its "
        "prefill failed (the new decode worker resumes after the tokens already sent; 0: never)",
    )
    generate_timeout_s: float = setting(
        600.0,
        "cluster: deadline of one attempt's decode stream, prefill included; past it the "
        "request ends with an error",
        metavar="SECONDS",
    )
    slo_ttft_ms: float | None = setting(
        None, "goodput metric: a good request's first token within this (default: not checked)"
    )
    slo_itl_ms: float | None = setting(
        None,
        "goodput metric: a good request's every inter-token gap within this (default: not checked)",
    )
    worker_keepalive_s: float = setting(
        5.0,
        "cluster: ping each decode worker's connection this often while it streams, and drop "
        "the connection when a ping goes unanswered as long: a stream on a worker cut off from "
        "the network moves within about twice this",
        metavar="SECONDS",
    )
    log_level: str = setting("info", "log level", parse=log_level, choices=LOG_LEVELS)
    # How the cluster backend's calls to the scheduler and decode workers authenticate.
    cluster: ClusterAuthArgs = field(default_factory=ClusterAuthArgs)
    fault_args: FaultArgs = field(default_factory=FaultArgs)
    # The local backend's engine; the cluster backend reads only model and max_model_len.
    engine: EngineConfig = field(default_factory=EngineConfig)
    tuning: Tuning = field(default_factory=Tuning)

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{name}={port} is not a port number")
        if self.backend == "cluster" and not self.scheduler:
            raise ValueError("backend=cluster needs --scheduler HOST:PORT")
        positive = (
            "max_body_bytes",
            "default_max_tokens",
            "default_chat_max_tokens",
            "max_concurrent_requests",
            "rate_limit_burst",
            "max_connections",
        )
        for name in positive:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests={self.max_queued_requests} must be >= 0")
        for name in ("queue_timeout_s", "write_timeout_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if not self.rate_limit_rps >= 0:
            raise ValueError(f"rate_limit_rps={self.rate_limit_rps} must be >= 0")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations={self.max_migrations} must be >= 0")
        if not self.worker_keepalive_s > 0:
            raise ValueError(f"worker_keepalive_s={self.worker_keepalive_s} must be > 0")
        if not self.generate_timeout_s > 0:
            raise ValueError(f"generate_timeout_s={self.generate_timeout_s} must be > 0")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s={self.drain_timeout_s} must be >= 0")
        for name in ("slo_ttft_ms", "slo_itl_ms"):
            bound = getattr(self, name)
            if bound is not None and not bound > 0:
                raise ValueError(f"{name}={bound} must be > 0")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be blank")
        if any(not k for k in self.api_keys):
            raise ValueError("api_keys must not contain an empty key")

    @property
    def concurrency(self) -> int:
        """``max_concurrent_requests``, or the start of the default (which then follows the
        fleet: ``admission``)."""
        return self.max_concurrent_requests or self.engine.max_num_seqs

    @property
    def follows_fleet(self) -> bool:
        """Whether the concurrency follows the fleet's target batch (not given)."""
        return self.max_concurrent_requests is None

    @property
    def queue_size(self) -> int:
        """``max_queued_requests``, its default resolved (it does not follow the fleet)."""
        queued = self.max_queued_requests
        return self.concurrency if queued is None else queued


load_config = settings.loader(GatewayConfig, "gateway", "python -m services.gateway", ABOUT)

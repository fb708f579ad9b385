"""``WorkerArgs``: the settings every engine worker (prefill, decode) shares: where it
serves, how it joins the scheduler, how it drains."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import LOG_LEVELS, log_level
from services.common.settings import setting


@dataclass(frozen=True)
class WorkerArgs:
    """Where a worker serves and whom it tells. ``ValueError`` on an impossible value."""

    host: str = setting("127.0.0.1", "address to bind")
    advertise_host: str | None = setting(
        None,
        "address peers use to reach this process (default: --host, or 127.0.0.1 when "
        "binding all interfaces; in containers: the hostname)",
    )
    port: int = setting(0, "gRPC port (0: any free port)")
    metrics_port: int = setting(0, "Prometheus /metrics port (0: off)")
    worker_id: str | None = setting(None, "unique id (default: role-host-port)")
    scheduler: str | None = setting(
        None, "register with this scheduler and heartbeat to it", metavar="HOST:PORT"
    )
    heartbeat_interval_s: float = setting(1.0, "seconds between heartbeats")
    drain_timeout_s: float = setting(
        30.0, "on SIGTERM, how long in-flight requests may finish before they are cancelled"
    )
    log_level: str = setting("info", "log level", parse=log_level, choices=LOG_LEVELS)

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be a port number, got {getattr(self, name)}")
        if self.heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")

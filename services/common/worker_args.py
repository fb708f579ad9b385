"""The settings every engine worker (prefill, decode) shares: ``WorkerArgs`` (where it
serves, how it joins the scheduler, how it drains) and ``MooncakeArgs`` (how its Mooncake
Transfer Engine moves KV, for the ``mooncake`` transport)."""

from __future__ import annotations

import socket
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

    @property
    def reachable_host(self) -> str:
        """The name peers dial: ``advertise_host``, else ``host`` unless that is a wildcard
        (then this machine's name)."""
        if self.advertise_host:
            return self.advertise_host
        return socket.getfqdn() if self.host in ("", "0.0.0.0", "::") else self.host


MOONCAKE_PROTOCOLS = ("auto", "tcp", "rdma")


@dataclass(frozen=True)
class MooncakeArgs:
    """The ``mooncake`` transport's settings (its Transfer Engine's protocol and devices)."""

    mooncake_protocol: str = setting(
        "auto",
        "mooncake transport: rdma, tcp, or auto (rdma when this host has an RDMA device)",
        choices=MOONCAKE_PROTOCOLS,
    )
    mooncake_devices: tuple[str, ...] = setting(
        (), "mooncake transport: comma list of the RDMA devices it may use (default: all)"
    )

    def options(self, host: str) -> dict[str, object]:
        """``MooncakeTransport``'s options for an engine peers reach at ``host``."""
        return {
            "host": host,
            "protocol": self.mooncake_protocol,
            "devices": self.mooncake_devices,
        }

"""The settings every engine worker (prefill, decode) shares: ``WorkerArgs`` (where it
serves, how it joins the scheduler, how it drains) and ``MooncakeArgs`` (how its Mooncake
Transfer Engine moves KV, for the ``mooncake`` transport)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from services.common.settings import LOG_LEVELS, log_level, machine_cpu_list, setting


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
MIN_SEGMENT_MIB = 16  # Mooncake Store's setup refuses 8 and 12 MiB (-600), takes 16 and 20


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


@dataclass(frozen=True)
class KVStoreArgs:
    """The KV store below the engine's pool (``kvstore``; docs/operations.md, "KV store")."""

    kv_store: str | None = setting(
        None,
        "the KV store's mooncake_master (HOST:PORT): full KV blocks this engine computes go "
        "there, and prefixes any engine computed are loaded from there instead of computed "
        "(default: no store)",
        metavar="HOST:PORT",
        env="PDSERVE_KV_STORE",
    )
    kv_store_segment_mib: int = setting(
        256,
        "MiB of this process's DRAM lent to the store's pool (0: the store is off; else at "
        "least 16)",
        env="PDSERVE_KV_STORE_SEGMENT_MIB",
    )
    kv_store_protocol: str = setting(
        "auto",
        "how the store moves bytes: rdma, tcp, or auto (rdma when this host has an RDMA device)",
        choices=MOONCAKE_PROTOCOLS,
    )
    kv_store_ssd_dir: str | None = setting(
        None,
        "an existing directory for this process's SSD tier of the store (default: DRAM "
        "only; the master must run with --enable_offload=true)",
        metavar="DIR",
    )
    kv_store_replicas: int = setting(
        2,
        "copies of each block the store keeps, in distinct workers' segments: a block "
        "outlives the death of replicas - 1 workers (fewer copies while there are fewer "
        "segments)",
        env="PDSERVE_KV_STORE_REPLICAS",
    )
    kv_store_write_buffer_mib: int = setting(
        128,
        "MiB of blocks waiting to be stored; blocks computed while it is full are dropped "
        "(counted), never waited for",
    )
    kv_store_cpus: frozenset[int] | None = setting(
        None,
        "run the store's threads (its block copier and putter, its loaders, and the store "
        "client's own transfer threads) on these cores (comma list), so that none runs on "
        "the engine's core (pdserve up --pin gives a decode worker the control cores; "
        "default: the process's cores)",
        parse=machine_cpu_list,
        metavar="CPUS",
    )
    kv_store_load_timeout_s: float = setting(
        2.0, "how long a prefix load may take before the prompt is computed instead"
    )
    kv_store_min_load_blocks: int = setting(
        1,
        "load from the store only runs of at least this many blocks (measured: loading a "
        "block beats computing it at every length here; docs/benchmarks.md, 'KV store')",
    )

    def __post_init__(self) -> None:
        if self.kv_store_segment_mib < 0 or 0 < self.kv_store_segment_mib < MIN_SEGMENT_MIB:
            raise ValueError(
                f"kv_store_segment_mib must be 0 (off) or at least {MIN_SEGMENT_MIB} (Mooncake "
                f"refuses smaller segments), got {self.kv_store_segment_mib}"
            )
        if self.kv_store_replicas < 1:
            raise ValueError(f"kv_store_replicas must be >= 1, got {self.kv_store_replicas}")
        if self.kv_store_write_buffer_mib < 1:
            raise ValueError("kv_store_write_buffer_mib must be >= 1")
        if self.kv_store_load_timeout_s <= 0:
            raise ValueError("kv_store_load_timeout_s must be > 0")
        if self.kv_store_min_load_blocks < 1:
            raise ValueError("kv_store_min_load_blocks must be >= 1")
        if self.kv_store is not None and ":" not in self.kv_store:
            raise ValueError(f"kv_store must be HOST:PORT, got {self.kv_store!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.kv_store) and self.kv_store_segment_mib > 0

"""The scheduler's configuration: one frozen dataclass, its CLI flags and env vars.

Precedence: command-line flag > ``PDSERVE_SCHEDULER_<FIELD>`` environment variable > the
default written on the field. Flags are derived from the fields (``--grpc-port`` for
``grpc_port``; durations drop their ``_s`` unit suffix: ``--heartbeat-ttl``), and the
environment is read here and nowhere else.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.scheduler.policy import AdmissionLimits
from services.scheduler.state import StateConfig

ENV_PREFIX = "PDSERVE_SCHEDULER_"


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class SchedulerConfig:
    """Everything the scheduler process is told; validated on construction."""

    grpc_host: str = _opt("0.0.0.0", "address the gRPC server binds")
    grpc_port: int = _opt(50051, "gRPC port (0: pick a free one and log it)")
    metrics_host: str = _opt("0.0.0.0", "address the Prometheus /metrics server binds")
    metrics_port: int = _opt(9091, "Prometheus /metrics HTTP port (0: no metrics server)")
    redis_url: str = _opt(
        "redis://127.0.0.1:6379/0", "Redis URL; empty: run without Redis (no warm restart)"
    )
    redis_key_prefix: str = _opt("pdserve", "prefix of every Redis key the scheduler owns")
    redis_timeout_s: float = _opt(2.0, "deadline of each Redis call")
    heartbeat_ttl_s: float = _opt(
        3.0, "worker lease: a worker is dropped this long after its last heartbeat"
    )
    heartbeats_per_ttl: int = _opt(3, "heartbeats a worker sends per lease (interval = ttl / n)")
    queue_size: int = _opt(1024, "bound of the state loop's command queue")
    max_inflight: int = _opt(4096, "global cap on requests in flight across decode workers")
    max_waiting_per_worker: int = _opt(
        64, "sequences a worker may hold beyond its max_num_seqs (queued)"
    )
    max_queued_prompt_tokens: int = _opt(65536, "cap on a prefill worker's prompt-token backlog")
    local_prefill_max_tokens: int = _opt(
        0, "prompts this short are prefilled on the decode worker (0: never)"
    )
    request_ttl_s: float = _opt(3600.0, "TTL of request records in Redis")
    prefix_ttl_s: float = _opt(3600.0, "TTL of prefix-index sets in Redis (renewed on add)")
    store_queue_size: int = _opt(8192, "bound of the Redis write-behind queue")
    drain_grace_s: float = _opt(5.0, "on SIGTERM: how long in-flight RPCs may finish")
    log_level: str = _opt("info", "debug, info, warning or error")

    def __post_init__(self) -> None:
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
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("grpc_port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be a port number, got {getattr(self, name)!r}")
        for name in ("max_waiting_per_worker", "local_prefill_max_tokens", "drain_grace_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level must be debug, info, warning or error: {self.log_level}")

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
        )


def flag_name(field_name: str) -> str:
    """``heartbeat_ttl_s`` → ``--heartbeat-ttl``."""
    return "--" + field_name.removesuffix("_s").replace("_", "-")


def env_name(field_name: str) -> str:
    """``heartbeat_ttl_s`` → ``PDSERVE_SCHEDULER_HEARTBEAT_TTL_S``."""
    return ENV_PREFIX + field_name.upper()


def _fields() -> tuple[dataclasses.Field[Any], ...]:
    return dataclasses.fields(SchedulerConfig)


def _convert(f: dataclasses.Field[Any], text: str) -> Any:
    kind = type(f.default)
    return kind(text)


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m services.scheduler`` argument parser, one flag per config field."""
    parser = argparse.ArgumentParser(
        prog="python -m services.scheduler",
        description="pdserve scheduler: placement, admission and the worker registry "
        f"(every flag also reads {ENV_PREFIX}<FIELD>, e.g. {env_name('grpc_port')}).",
    )
    for f in _fields():
        parser.add_argument(
            flag_name(f.name),
            dest=f.name,
            type=type(f.default),
            default=None,
            help=f"{f.metadata['help']} (default: {f.default!r}; env {env_name(f.name)})",
        )
    return parser


def load_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> SchedulerConfig:
    """Build the config from defaults, then ``environ`` (default ``os.environ``), then argv.

    Exits with status 2 (argparse) on a bad flag, env value or combination.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in _fields():
        raw = env.get(env_name(f.name))
        if raw is not None:
            try:
                values[f.name] = _convert(f, raw)
            except ValueError:
                parser.error(
                    f"{env_name(f.name)}={raw!r} is not a valid {type(f.default).__name__}"
                )
        cli = getattr(args, f.name)
        if cli is not None:
            values[f.name] = cli
    try:
        return SchedulerConfig(**values)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits

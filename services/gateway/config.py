"""The gateway's configuration: one frozen dataclass, its CLI flags and environment.

Every field is a flag (``--http-port``) and an environment variable
(``PDSERVE_GATEWAY_HTTP_PORT``); precedence is flag > environment > default. This module
is the only place that reads the environment.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

ENV_PREFIX = "PDSERVE_GATEWAY_"
BACKENDS = ("local", "cluster")
DTYPES = ("float32", "bfloat16", "float16")
LOG_LEVELS = ("debug", "info", "warning", "error")


def _f(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway process needs. Validated on construction (``ValueError``)."""

    host: str = _f("0.0.0.0", "address to listen on (HTTP and gRPC)")
    http_port: int = _f(8000, "OpenAI-compatible HTTP port (0: any free port)")
    grpc_port: int = _f(50051, "gRPC Gateway port (0: any free port)")
    backend: str = _f(
        "local",
        "where generation runs; 'local': an engine in this process; 'cluster': the scheduler "
        "places each request on prefill/decode workers",
        choices=BACKENDS,
    )
    scheduler: str | None = _f(None, "scheduler gRPC address HOST:PORT (cluster backend)")
    model: str | None = _f(None, "checkpoint (GGUF file or HF dir); default: embedded SmolLM2")
    served_model_name: str | None = _f(
        None, "model name clients use; default: the checkpoint's file or directory name"
    )
    api_keys: tuple[str, ...] = _f(
        (), "comma-separated accepted bearer keys; empty: no authentication"
    )
    max_body_bytes: int = _f(4 << 20, "largest accepted HTTP request body (413 above)")
    default_max_tokens: int = _f(16, "max_tokens when a completion request omits it")
    default_chat_max_tokens: int = _f(
        1024,
        "max_tokens cap when a chat request omits it (the rest of the context, at most this)",
    )
    max_concurrent_requests: int = _f(
        256, "requests in flight before new ones get 429 / RESOURCE_EXHAUSTED"
    )
    drain_timeout_s: float = _f(30.0, "on SIGTERM, how long in-flight streams may finish")
    log_level: str = _f("info", "log level", choices=LOG_LEVELS)
    switch_interval_ms: float = _f(
        0.5,
        "Python's thread switch interval: the event loop relaying tokens shares the GIL with "
        "gRPC's threads, and waits up to this long to get it back (Python's default is 5 ms)",
    )
    # local backend: the engine's settings
    dtype: str = _f("float32", "engine dtype (local backend)", choices=DTYPES)
    threads: int | None = _f(None, "torch intra-op threads (local backend)")
    block_size: int = _f(16, "tokens per KV block (local backend)")
    kv_cache_mib: int = _f(1024, "KV pool size in MiB (local backend)")
    max_model_len: int | None = _f(None, "context length; default: the checkpoint's")
    max_num_seqs: int = _f(64, "most sequences in the running batch (local backend)")
    chunked_prefill: int = _f(0, "prefill chunk size in tokens; 0: off (local backend)")
    enable_prefix_caching: bool = _f(True, "reuse KV of shared prompt prefixes (local backend)")

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"{name}={port} is not a port number")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is not one of {BACKENDS}")
        if self.backend == "cluster" and not self.scheduler:
            raise ValueError("backend=cluster needs --scheduler HOST:PORT")
        positive = (
            "max_body_bytes",
            "default_max_tokens",
            "default_chat_max_tokens",
            "max_concurrent_requests",
            "block_size",
            "kv_cache_mib",
            "max_num_seqs",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not 0 < self.switch_interval_ms <= 100:
            raise ValueError(f"switch_interval_ms={self.switch_interval_ms} must be > 0 and <= 100")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s={self.drain_timeout_s} must be >= 0")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be blank")
        if any(not k for k in self.api_keys):
            raise ValueError("api_keys must not contain an empty key")

    def engine_config(self):  # -> engine.llm_engine.EngineConfig (lazy: keeps torch out of --help)
        """The local backend's ``EngineConfig``."""
        from engine.llm_engine import EngineConfig

        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            block_size=self.block_size,
            kv_cache_bytes=self.kv_cache_mib << 20,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            chunked_prefill=self.chunked_prefill > 0,
            max_num_batched_tokens=self.chunked_prefill or None,
            enable_prefix_caching=self.enable_prefix_caching,
            num_threads=self.threads,
        )

    @classmethod
    def from_sources(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> GatewayConfig:
        """Build from command-line flags over ``PDSERVE_GATEWAY_*`` variables over defaults.

        A malformed value in either source exits with argparse's usage error (status 2).
        """
        env = os.environ if environ is None else environ
        parser = build_parser()
        defaults: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                try:
                    defaults[f.name] = _convert(f.type, raw)
                except ValueError as exc:
                    parser.error(f"{ENV_PREFIX}{f.name.upper()}={raw!r}: {exc}")
        parser.set_defaults(**defaults)
        args = parser.parse_args(argv)
        try:
            return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})
        except ValueError as exc:
            parser.error(str(exc))
            raise  # unreachable: parser.error exits


def _convert(type_name: Any, raw: str) -> Any:
    """Parse one flag or variable value for a field annotated ``type_name`` (a string under
    ``from __future__ import annotations``)."""
    t = str(type_name).replace(" | None", "")
    if raw == "" and "None" in str(type_name):
        return None
    if t == "bool":
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected a boolean (true/false), got {raw!r}")
    if t in ("int", "float"):
        try:
            return int(raw) if t == "int" else float(raw)
        except ValueError:
            kind = "an integer" if t == "int" else "a number"
            raise ValueError(f"expected {kind}, got {raw!r}") from None
    if t == "tuple[str, ...]":
        return tuple(k.strip() for k in raw.split(",") if k.strip())
    return raw


def build_parser() -> argparse.ArgumentParser:
    """The gateway's flags: one per ``GatewayConfig`` field, with its default and help."""
    parser = argparse.ArgumentParser(
        prog="python -m services.gateway",
        description="pdserve gateway: OpenAI-compatible HTTP and gRPC Generate. Every flag can "
        f"also be set as {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}HTTP_PORT=8000).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for f in fields(GatewayConfig):
        assert f.default is not MISSING
        flag = "--" + f.name.replace("_", "-")
        meta = f.metadata
        if str(f.type) == "bool":
            parser.add_argument(
                flag,
                dest=f.name,
                default=f.default,
                action=argparse.BooleanOptionalAction,
                help=meta["help"],
            )
            continue

        def conv(raw: str, _type: Any = f.type) -> Any:
            try:
                return _convert(_type, raw)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None

        parser.add_argument(
            flag,
            dest=f.name,
            default=f.default,
            type=conv,
            choices=meta.get("choices"),
            help=meta["help"],
        )
    return parser

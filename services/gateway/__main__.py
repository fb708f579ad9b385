"""``python -m services.gateway``: run the gateway (HTTP on one port, gRPC on another).

Start-up: build the backend (``--backend local``: load the engine in this process) ->
listen -> report SERVING and print ``READY gateway <host>:<http port> grpc=<host>:<grpc port>``
on stdout (logs are JSON lines on stderr). SIGTERM or SIGINT: report NOT_SERVING and refuse
new generations (503 / UNAVAILABLE) -> stop listening -> let in-flight streams finish for up to
``--drain-timeout-s`` (then cancel them) -> stop the engine -> exit 0. The process shell is
``services.common.process``; the settings are ``services.gateway.config``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from services.common import process
from services.gateway.config import GatewayConfig, load_config

if TYPE_CHECKING:  # the servers pull in the engine (torch): imported after --help
    from services.gateway.cluster_backend import ClusterBackend
    from services.gateway.engine_backend import EngineBackend
    from services.gateway.served_model import ServedModel
    from services.gateway.service import GatewayService

log = structlog.get_logger("services.gateway")

_HEALTH_REFRESH_S = 5.0


def _default_model_name(model: str | None) -> str:
    from engine.checkpoint import default_model_path

    path = Path(model) if model else default_model_path()
    return path.name.removesuffix(".gguf") if path.is_file() else path.name


def _build_local(cfg: GatewayConfig) -> tuple[EngineBackend, ServedModel]:
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import LLMEngine
    from services.gateway.engine_backend import EngineBackend
    from services.gateway.served_model import ServedModel

    engine = LLMEngine(cfg.engine.resolved(cpus=cfg.tuning.engine_cpus))
    name = cfg.served_model_name or _default_model_name(cfg.engine.model)
    aengine = AsyncEngine(engine, **cfg.tuning.engine_options())
    backend = EngineBackend(aengine)
    return backend, ServedModel.for_engine(name, engine)


def _build_cluster(cfg: GatewayConfig) -> tuple[ClusterBackend, ServedModel]:
    """Tokenizer and limits from the checkpoint's metadata; no weights in this process."""
    import json

    from engine.checkpoint import default_model_path
    from engine.gguf_file import read_metadata
    from engine.tokenizer import Tokenizer
    from services.gateway.cluster_backend import ClusterBackend
    from services.gateway.served_model import ServedModel

    model = cfg.engine.model
    path = Path(model) if model else default_model_path()
    tokenizer = Tokenizer.from_path(path)
    if path.is_file():
        context = int(read_metadata(path)["llama.context_length"])
    else:
        context = int(json.loads((path / "config.json").read_text())["max_position_embeddings"])
    checkpoint_name = _default_model_name(model)
    assert cfg.scheduler is not None
    backend = ClusterBackend(
        cfg.scheduler,
        worker_model=checkpoint_name,
        max_migrations=cfg.max_migrations,
        worker_keepalive_s=cfg.worker_keepalive_s,
        generate_timeout_s=cfg.generate_timeout_s,
        room_wait_s=cfg.queue_timeout_s,
    )
    name = cfg.served_model_name or checkpoint_name
    max_len = min(cfg.engine.max_model_len or context, context)
    return backend, ServedModel(name, tokenizer, max_len, tokenizer.vocab_size)


async def _refresh_health(service: GatewayService, server: process.GrpcServer) -> None:
    """Keep gRPC health in step with the backend until draining starts."""
    while not service.draining:
        await asyncio.sleep(_HEALTH_REFRESH_S)
        if not service.draining:
            await server.set_serving(await service.ready())


async def serve(cfg: GatewayConfig) -> None:
    """Run until SIGTERM/SIGINT, then drain."""
    from services.gateway.admission import AdmissionLimits
    from services.gateway.cluster_backend import ClusterBackend
    from services.gateway.grpc_server import grpc_server
    from services.gateway.http_server import HttpServer, create_app
    from services.gateway.metrics import GatewayMetrics, LatencySlo
    from services.gateway.openai_api import Limits
    from services.gateway.service import GatewayService

    build = _build_cluster if cfg.backend == "cluster" else _build_local
    backend, model = await asyncio.to_thread(build, cfg)
    backend.start()
    service = GatewayService(
        backend,
        [model],
        metrics=GatewayMetrics(model.name, LatencySlo.from_ms(cfg.slo_ttft_ms, cfg.slo_itl_ms)),
        limits=Limits(cfg.default_max_tokens, cfg.default_chat_max_tokens),
        api_keys=cfg.api_keys,
        admission=AdmissionLimits(
            max_concurrent=cfg.concurrency,
            max_queued=cfg.queue_size,
            queue_timeout_s=cfg.queue_timeout_s,
            rate_per_key=cfg.rate_limit_rps,
            burst=cfg.rate_limit_burst,
            follow_fleet=cfg.follows_fleet,
        ),
    )
    backend.on_target_batch = service.admission.follow
    if isinstance(backend, ClusterBackend):
        backend.on_migration = service.metrics.count_migration
    else:  # the local engine's batch target, before the first request (a worker's: READY)
        await backend.engine.calibrate()
    app = create_app(
        service, max_body_bytes=cfg.max_body_bytes, write_timeout_s=cfg.write_timeout_s
    )
    http = HttpServer(
        app, cfg.host, cfg.http_port, cfg.drain_timeout_s, max_connections=cfg.max_connections,
        idle_timeout_s=cfg.idle_timeout_s,
    )  # fmt: skip
    server = grpc_server(
        service, cfg.host, cfg.grpc_port, max_message_bytes=cfg.max_body_bytes,
        write_timeout_s=cfg.write_timeout_s,
    )  # fmt: skip
    await http.start()
    log.info("gateway_started", model=model.name, max_model_len=model.max_model_len,
             http_port=http.port, grpc_port=server.port, max_concurrent=cfg.concurrency,
             max_queued=cfg.queue_size,
             follows_fleet=cfg.follows_fleet)  # fmt: skip

    async def drain() -> None:
        service.start_draining()  # new generations: 503 / UNAVAILABLE
        await http.stop()  # in-flight HTTP streams finish (or are cancelled) first

    try:
        await process.serve(
            server,
            role="gateway",
            drain_timeout_s=cfg.drain_timeout_s,
            on_drain=drain,
            background=[_refresh_health(service, server)],
            address=f"{process.reachable(cfg.host)}:{http.port}",
            ready={"grpc": server.address},
        )
    finally:
        await backend.stop()


def main(argv: Sequence[str] | None = None) -> int:
    cfg = load_config(argv)
    cluster = cfg.cluster if cfg.backend == "cluster" else None  # local: no internal calls
    return process.run("gateway", cfg.log_level, serve(cfg), cfg.tuning, cluster, cfg.fault_args)


if __name__ == "__main__":
    sys.exit(main())

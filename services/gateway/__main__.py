"""``python -m services.gateway``: run the gateway (HTTP on one port, gRPC on another).

Start-up: build the backend (``--backend local``: load the engine in this process) ->
listen -> report SERVING and print ``READY gateway <host>:<http port> grpc=<host>:<grpc port>``
on stdout (logs are JSON lines on stderr). SIGTERM or SIGINT: report NOT_SERVING and refuse
new generations (503 / UNAVAILABLE) -> stop listening -> let in-flight streams finish for up to
``--drain-timeout-s`` (then cancel them) -> stop the engine -> exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from services.gateway.config import GatewayConfig
from services.gateway.logging_setup import configure_logging

if TYPE_CHECKING:  # the servers pull in the engine (torch): imported after --help
    from services.gateway.cluster_backend import ClusterBackend
    from services.gateway.engine_backend import EngineBackend
    from services.gateway.grpc_server import GrpcServer
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

    engine = LLMEngine(cfg.engine_config())
    name = cfg.served_model_name or _default_model_name(cfg.model)
    backend = EngineBackend(AsyncEngine(engine), max_active=cfg.max_concurrent_requests)
    return backend, ServedModel.for_engine(name, engine)


def _build_cluster(cfg: GatewayConfig) -> tuple[ClusterBackend, ServedModel]:
    """Tokenizer and limits from the checkpoint's metadata; no weights in this process."""
    import json

    from engine.checkpoint import default_model_path
    from engine.tokenizer import Tokenizer, read_gguf_metadata
    from services.gateway.cluster_backend import ClusterBackend
    from services.gateway.served_model import ServedModel

    path = Path(cfg.model) if cfg.model else default_model_path()
    tokenizer = Tokenizer.from_path(path)
    if path.is_file():
        context = int(read_gguf_metadata(path)["llama.context_length"])
    else:
        context = int(json.loads((path / "config.json").read_text())["max_position_embeddings"])
    checkpoint_name = _default_model_name(cfg.model)
    assert cfg.scheduler is not None
    backend = ClusterBackend(cfg.scheduler, worker_model=checkpoint_name)
    name = cfg.served_model_name or checkpoint_name
    max_len = min(cfg.max_model_len or context, context)
    return backend, ServedModel(name, tokenizer, max_len, tokenizer.vocab_size)


async def _refresh_health(service: GatewayService, grpc_server: GrpcServer) -> None:
    """Keep gRPC health in step with the backend until draining starts."""
    while not service.draining:
        await asyncio.sleep(_HEALTH_REFRESH_S)
        if not service.draining:
            await grpc_server.set_serving(await service.ready())


async def serve(cfg: GatewayConfig) -> int:
    """Run until SIGTERM/SIGINT, then drain and return the exit status."""
    from services.gateway.grpc_server import GrpcServer
    from services.gateway.http_server import HttpServer, create_app
    from services.gateway.openai_api import Limits
    from services.gateway.service import GatewayService

    build = _build_cluster if cfg.backend == "cluster" else _build_local
    backend, model = await asyncio.to_thread(build, cfg)
    backend.start()
    service = GatewayService(
        backend,
        [model],
        limits=Limits(cfg.default_max_tokens, cfg.default_chat_max_tokens),
        api_keys=cfg.api_keys,
    )
    app = create_app(service, max_body_bytes=cfg.max_body_bytes)
    http = HttpServer(app, cfg.host, cfg.http_port, cfg.drain_timeout_s)
    grpc_server = GrpcServer(service, cfg.host, cfg.grpc_port, max_message_bytes=cfg.max_body_bytes)
    await http.start()
    await grpc_server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    refresher = asyncio.create_task(_refresh_health(service, grpc_server))
    # The line process supervisors (and tests) wait for, as the other services print it.
    host = cfg.host if cfg.host not in ("", "0.0.0.0", "[::]", "::") else "127.0.0.1"
    print(f"READY gateway {host}:{http.port} grpc={host}:{grpc_server.port}", flush=True)
    log.info(
        "gateway_started",
        model=model.name,
        max_model_len=model.max_model_len,
        http_port=http.port,
        grpc_port=grpc_server.port,
    )
    await stop.wait()

    log.info("gateway_draining", drain_timeout_s=cfg.drain_timeout_s)
    service.start_draining()
    refresher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await refresher
    await grpc_server.drain()
    await asyncio.gather(grpc_server.stop(cfg.drain_timeout_s), http.stop())
    await backend.stop()
    log.info("gateway_stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    cfg = GatewayConfig.from_sources(argv)
    configure_logging(cfg.log_level)
    sys.setswitchinterval(cfg.switch_interval_ms / 1000.0)
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        return runner.run(serve(cfg))


if __name__ == "__main__":
    sys.exit(main())

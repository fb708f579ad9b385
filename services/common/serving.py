"""What every pdserve service process shares: logs, gRPC server with health, metrics, drain.

SIGTERM/SIGINT drain: health goes NOT_SERVING first (load balancers and the scheduler stop
sending work), in-flight RPCs get ``grace`` seconds to finish, then the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Iterable

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server


def configure_logging(service: str, level: str = "INFO") -> None:
    """structlog JSON lines on stderr; bind ``request_id`` with structlog.contextvars."""
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service, pid=os.getpid())


def install_uvloop() -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep the fallback honest
        structlog.get_logger().warning("uvloop_missing")


def start_metrics(port: int, host: str = "0.0.0.0") -> None:
    """Prometheus ``/metrics`` on its own HTTP port (0 = disabled)."""
    if port:
        start_http_server(port, addr=host)


class GrpcService:
    """A grpc.aio server with ``grpc.health.v1`` and a drain on SIGTERM."""

    def __init__(self, name: str, host: str, port: int, advertise_host: str | None = None) -> None:
        self.name = name
        self.advertise_host = advertise_host
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20),
            ]
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"{name}: cannot bind gRPC port {host}:{port}")
        self.host = host
        self._stopping = asyncio.Event()

    @property
    def address(self) -> str:
        """Where peers reach this server (what is registered with the scheduler)."""
        host = self.advertise_host or (
            self.host if self.host not in ("0.0.0.0", "::", "[::]") else "127.0.0.1"
        )
        return f"{host}:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for svc in ("", self.name):
            await self.health.set(svc, status)

    async def run(
        self,
        *,
        grace: float,
        on_drain: Callable[[], Awaitable[None]] | None = None,
        background: Iterable[Awaitable[None]] = (),
    ) -> None:
        """Serve until SIGTERM/SIGINT, then drain and stop."""
        await self.server.start()
        await self.set_serving(True)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        tasks = [asyncio.ensure_future(b) for b in background]
        structlog.get_logger().info("serving", address=self.address)
        await self._stopping.wait()
        structlog.get_logger().info("draining", grace_seconds=grace)
        await self.set_serving(False)
        if on_drain is not None:
            try:
                await asyncio.wait_for(on_drain(), grace)
            except TimeoutError:
                structlog.get_logger().warning("drain_timeout")
        await self.server.stop(grace)
        for t in tasks:
            t.cancel()
        structlog.get_logger().info("stopped")

    def stop(self) -> None:
        self._stopping.set()


def host_id() -> str:
    """Identifies the machine: shm transfer only works between workers with equal host ids."""
    return socket.gethostname()

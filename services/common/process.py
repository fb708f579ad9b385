"""The process shell every pdserve service starts through (gateway, scheduler, prefill,
decode): JSON logs, uvloop, the Prometheus server, a gRPC server with health and
reflection, the ``READY`` line, and the drain on SIGTERM/SIGINT.

Lifecycle of a process: ``run`` (logs, tuning, uvloop) -> the service builds its parts ->
``serve``: start the gRPC server (SERVING) -> print ``READY <role> <address>`` -> wait for
a signal -> NOT_SERVING -> the service's ``on_drain`` (new work refused, in-flight work
finishing) -> stop the server, cancelling what still runs when ``drain_timeout_s`` since
the signal is spent -> return to the service, which closes what it owns.

The Prometheus ``/metrics`` server of the workers and the scheduler (``serve_metrics``)
always answers in the classic text format, whatever the scraper's ``Accept`` asks, as the
gateway's ``/metrics`` does. prometheus_client's OpenMetrics output, which Prometheus 2.x
asks for first, writes a ``pdserve:x`` sample as ``pdserve_x`` while its ``# TYPE`` line
keeps the colon (prometheus/client_python#1177, open), so the stored names would depend on
the scraper and the client's version, and no dashboard could name them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import channels, cluster_auth
from services.common.faults import FaultArgs, install_rpc_faults

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from services.common.tuning import Tuning

_ALL_INTERFACES = ("", "0.0.0.0", "::", "[::]")

log = structlog.get_logger(__name__)


def configure_logging(service: str, level: str) -> None:
    """structlog JSON lines on stderr at ``level`` and above, each carrying ``service`` and
    ``pid`` (and ``request_id`` where an edge binds it with structlog.contextvars);
    stdlib loggers (grpc, aiohttp) at WARNING and above."""
    numeric = logging.getLevelNamesMapping()[level.upper()]
    logging.basicConfig(
        stream=sys.stderr, level=max(numeric, logging.WARNING), format="%(message)s"
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service, pid=os.getpid())


def run(
    service: str,
    level: str,
    main: Coroutine[Any, Any, int | None],
    tuning: Tuning | None = None,
    cluster: cluster_auth.ClusterAuthArgs | None = None,
    faults: FaultArgs | None = None,
) -> int:
    """Start a service process: logs, then its cluster auth from ``cluster`` (installed for
    the process: ``cluster_auth.channel``; an unreadable file exits 2), its fault spec (for
    its internal gRPC clients; tests and chaos runs only), then ``tuning`` (once), then
    ``main`` on uvloop; returns the exit status (``main``'s, 0 for None)."""
    import uvloop

    configure_logging(service, level)
    if faults is not None and faults.faults:  # parsed only when set: transfer pulls in torch
        spec = faults.spec
        install_rpc_faults(spec)
        log.warning("faults_injected", spec=str(spec))
    if cluster is not None:
        try:
            cluster_auth.install(cluster_auth.load(cluster), service)
        except ValueError as e:
            main.close()
            log.error("cluster_auth_unusable", error=str(e))
            return 2
    if tuning is not None:
        tuning.apply()
    return uvloop.run(main) or 0


def start_metrics(port: int, host: str, registry: CollectorRegistry | None = None) -> None:
    """Prometheus ``/metrics`` (text format) on its own HTTP port, on a daemon thread (0:
    none); ``registry`` defaults to prometheus_client's global one."""
    from prometheus_client import REGISTRY

    if port:
        serve_metrics(host, port, REGISTRY if registry is None else registry)


class MetricsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        # IPv6 hosts ("::") too: the family is the address's, not always AF_INET.
        host, port = address
        self.address_family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
        super().__init__(address, handler)


def serve_metrics(host: str, port: int, registry: CollectorRegistry) -> MetricsServer:
    """Serve ``registry`` on ``host:port`` (0: a free port, read ``server_address``) at any
    path in the text format, on a daemon thread; ``shutdown()`` stops it. ``OSError`` if it
    cannot bind."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # one line per scrape would bury the service's own logs

    server = MetricsServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


def reachable(host: str, advertise_host: str | None = None) -> str:
    """The host peers dial for a server bound to ``host``."""
    if advertise_host:
        return advertise_host
    return "127.0.0.1" if host in _ALL_INTERFACES else host


def print_ready(role: str, address: str, **extra: str) -> None:
    """``READY <role> <address> [key=value ...]`` on stdout: what ``pdserve up``, compose
    wrappers and tests wait for (logs go to stderr)."""
    tail = "".join(f" {k}={v}" for k, v in extra.items())
    print(f"READY {role} {address}{tail}", flush=True)


class GrpcServer:
    """A grpc.aio server on ``host:port`` (0: a free port) with ``grpc.health.v1`` and
    server reflection for ``services`` (full names, e.g. ``pdserve.v1.Scheduler``).

    Add servicers to ``server`` before ``start``. Health reports SERVING for "" and each of
    ``services`` from ``start`` on, NOT_SERVING for good from ``drain`` on. A message over
    ``max_message_bytes`` gets RESOURCE_EXHAUSTED. ``OSError`` when the port cannot be bound.
    ``auth``: an internal server's cluster auth (the token checked on every call but health
    and reflection, TLS when it has a certificate, and keepalive pings accepted at any rate);
    None: the gateway's public server.
    """

    def __init__(
        self,
        services: Sequence[str],
        host: str,
        port: int,
        *,
        advertise_host: str | None = None,
        max_message_bytes: int = 64 << 20,
        auth: cluster_auth.ClusterAuth | None = None,
    ) -> None:
        self.services = tuple(services)
        self.server = grpc.aio.server(
            interceptors=auth.interceptors() if auth is not None else (),
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.so_reuseport", 0),  # a port in use fails here, never shared
                # internal peers ping their calls to notice a silent host
                *(channels.SERVER_OPTIONS if auth is not None else ()),
            ],
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (*self.services, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        creds = auth.server_credentials() if auth is not None else None
        try:
            if creds is None:
                self.port = self.server.add_insecure_port(f"{host}:{port}")
            else:
                self.port = self.server.add_secure_port(f"{host}:{port}", creds)
        except RuntimeError as exc:  # grpc's "Failed to bind"
            raise OSError(f"cannot bind gRPC to {host}:{port}: {exc}") from None
        self.address = f"{reachable(host, advertise_host)}:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        await self.set_serving(True)

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.services):
            await self.health.set(name, status)

    async def drain(self) -> None:
        """Report NOT_SERVING from now on (balancers and the scheduler stop sending)."""
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace: float | None) -> None:
        """Refuse new calls; cancel those still running after ``grace`` seconds."""
        await self.server.stop(grace)


async def serve(
    server: GrpcServer,
    *,
    role: str,
    drain_timeout_s: float,
    on_drain: Callable[[], Awaitable[None]] | None = None,
    background: Iterable[Awaitable[None]] = (),
    address: str | None = None,
    ready: dict[str, str] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT, then drain within ``drain_timeout_s`` and stop.

    ``on_drain`` runs after health turns NOT_SERVING: it refuses new work and waits for
    work in flight; it is cancelled when the deadline passes, and the server stop gets what
    is left of it. ``background`` tasks run while serving and are cancelled at the end.
    The READY line names ``address`` (default: the gRPC server's) and ``ready``'s pairs.
    """
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await server.start()
    tasks = [asyncio.ensure_future(b) for b in background]
    log.info("serving", address=server.address)
    print_ready(role, address or server.address, **(ready or {}))
    await stopping.wait()
    deadline = time.monotonic() + drain_timeout_s
    log.info("draining", drain_timeout_s=drain_timeout_s)
    await server.drain()
    if on_drain is not None:
        try:
            await asyncio.wait_for(on_drain(), drain_timeout_s)
        except TimeoutError:
            log.warning("drain_timeout", drain_timeout_s=drain_timeout_s)
    await server.stop(max(0.0, deadline - time.monotonic()))
    for t in tasks:
        t.cancel()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
    log.info("stopped")

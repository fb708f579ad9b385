"""The Prometheus ``/metrics`` HTTP server of the workers and the scheduler.

Always the classic text format, whatever the scraper's ``Accept`` asks, as the
gateway's ``/metrics`` does. prometheus_client's OpenMetrics output, which Prometheus 2.x
asks for first, writes a ``pdserve:x`` sample as ``pdserve_x`` while its ``# TYPE`` line
keeps the colon (prometheus/client_python#1177, open), so the stored names would depend on
the scraper and the client's version, and no dashboard could name them.
"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class MetricsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        # IPv6 hosts ("::") too: the family is the address's, not always AF_INET.
        host, port = address
        self.address_family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
        super().__init__(address, handler)


def serve_metrics(host: str, port: int, registry: CollectorRegistry) -> MetricsServer:
    """Serve ``registry`` on ``host:port`` (0: a free port, read ``server_address``) at any
    path, on a daemon thread; ``shutdown()`` stops it. ``OSError`` if it cannot bind."""

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

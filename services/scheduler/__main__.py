"""``python -m services.scheduler``: run the scheduler on uvloop until SIGTERM or SIGINT.

Once serving it prints ``READY scheduler <host>:<grpc port>`` on stdout (logs go to stderr).

On SIGTERM the health service turns NOT_SERVING first, new placements are refused, RPCs in
flight get ``--drain-grace`` seconds to finish, queued Redis writes are flushed, and the
process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

import structlog
import uvloop

from services.scheduler.config import SchedulerConfig, load_config


def configure_logging(level: str) -> None:
    """JSON lines on stderr, one event per line, at ``level`` and above."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


async def run(config: SchedulerConfig) -> int:
    """Serve until a termination signal, then drain; returns the exit status."""
    from services.scheduler.server import SchedulerServer

    server = SchedulerServer(config)
    await server.start()
    # The line process supervisors (and tests) wait for, like the workers print.
    host = config.grpc_host if config.grpc_host not in ("", "0.0.0.0", "[::]") else "127.0.0.1"
    print(f"READY scheduler {host}:{server.grpc_port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(server.wait())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    await server.stop()
    for task in (waiter, stopper):
        task.cancel()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    config = load_config(argv)
    configure_logging(config.log_level)
    return uvloop.run(run(config))


if __name__ == "__main__":
    sys.exit(main())

"""structlog configured for the gateway process: one JSON object per line on stderr.

Context bound with ``structlog.contextvars`` (the edges bind ``request_id``) is merged into
every event logged while it is bound.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: str = "info") -> None:
    """Log JSON lines at ``level`` and above; stdlib loggers (aiohttp, grpc) at WARNING."""
    numeric = logging.getLevelNamesMapping()[level.upper()]
    logging.basicConfig(
        stream=sys.stderr, level=max(numeric, logging.WARNING), format="%(message)s"
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )

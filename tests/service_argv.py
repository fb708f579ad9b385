"""A container's command parsed by the service's own parser: shared by the offline checks
of compose/ (tests/compose) and deploy/k8s/ (tests/deploy)."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Any

from services.decode.config import load_config as decode_config
from services.gateway.config import load_config as gateway_config
from services.prefill.config import load_config as prefill_config
from services.scheduler.config import load_config as scheduler_config

ALL_INTERFACES = ("0.0.0.0", "::", "[::]")
# Each service's own ``load_config(argv, environ)``.
PARSERS: dict[str, Callable[..., Any]] = {
    "services.scheduler": scheduler_config,
    "services.gateway": gateway_config,
    "services.prefill": prefill_config,
    "services.decode": decode_config,
}
WORKERS = ("services.prefill", "services.decode")


class Problem(Exception):
    """One way a deployment file disagrees with the code."""


def parse_service(
    name: str, argv: list[str], environ: dict[str, str] | None = None
) -> tuple[str, Any]:
    """``python -m <module> flags...`` parsed by that module's own parser over ``environ``
    (default: no variables at all: the host's environment never leaks into the check)."""
    if argv[:2] != ["python", "-m"] or len(argv) < 3 or argv[2] not in PARSERS:
        raise Problem(f"{name}: command must be `python -m <one of {sorted(PARSERS)}>`: {argv}")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return argv[2], PARSERS[argv[2]](argv[3:], environ=environ or {})
    except SystemExit as e:
        raise Problem(f"{name}: {argv[2]} rejects its flags: {err.getvalue().strip()}") from e

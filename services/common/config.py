"""Parsers of config values argparse cannot read from a type alone: the ``parse`` hooks of
``services.common.settings`` fields (and argparse ``type=`` functions).

Each checks its value against this machine while parsing, so a value that cannot work is
a usage error (exit 2), not a failed start.
"""

from __future__ import annotations

import argparse

from engine.threads import check_cpus

LOG_LEVELS = ("debug", "info", "warning", "error")


def log_level(text: str) -> str:
    """A log level in any case; the field's ``choices`` (``LOG_LEVELS``) check the name."""
    return text.strip().lower()


def cpu_list(text: str) -> frozenset[int]:
    """A comma list of cores (``"0,2"``), each one this process may run on."""
    try:
        cores = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of core numbers: {text!r}") from None
    try:
        return check_cpus(cores)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None

"""Flags with environment defaults: ``PDSERVE_<SERVICE>_<FLAG>`` read in this one place."""

from __future__ import annotations

import argparse
import os

from engine.threads import check_cpus


def tcp_congestion(text: str) -> str:
    """argparse type of a flag naming a TCP congestion control: one this process may use,
    checked while parsing, so a refused name is a usage error (exit 2), not a failed start."""
    from transfer.errors import TransferError  # here: the transfer package imports torch
    from transfer.tcp_frames import check_congestion

    try:
        check_congestion(text)
    except TransferError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def cpu_list(text: str) -> set[int]:
    """argparse type of a comma list of cores (``"0,2"``), each one this process may run on."""
    try:
        cores = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of core numbers: {text!r}") from None
    try:
        return set(check_cpus(cores))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def apply_env_defaults(parser: argparse.ArgumentParser, service: str) -> None:
    """Let ``PDSERVE_<SERVICE>_<DEST>`` set any flag's default (the command line still wins).

    Values are parsed by the flag's own type, so a bad value fails like a bad flag.
    """
    prefix = f"PDSERVE_{service.upper()}_"
    for action in parser._actions:  # argparse offers no public iterator over actions
        if not action.dest or action.dest == "help":
            continue
        raw = os.environ.get(prefix + action.dest.upper())
        if raw is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = raw.lower() in ("1", "true", "yes", "on")
        elif action.type is not None:
            try:
                action.default = action.type(raw)
            except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
                parser.error(f"{prefix}{action.dest.upper()}={raw!r}: {exc}")
        else:
            action.default = raw


def add_service_flags(p: argparse.ArgumentParser, *, port: int, metrics_port: int) -> None:
    g = p.add_argument_group("service")
    g.add_argument("--host", default="127.0.0.1", help="address to bind")
    g.add_argument("--advertise-host", default=None,
                   help="address peers use to reach this process (default: --host, "
                   "or 127.0.0.1 when binding all interfaces; in containers: the "
                   "hostname)")  # fmt: skip
    g.add_argument("--port", type=int, default=port, help="gRPC port (0: any free port)")
    g.add_argument("--metrics-port", type=int, default=metrics_port,
                   help="Prometheus /metrics port (0: off)")  # fmt: skip
    g.add_argument("--worker-id", default=None, help="unique id (default: role-host-port)")
    g.add_argument("--scheduler", default=None, metavar="HOST:PORT",
                   help="register with this scheduler and heartbeat to it")  # fmt: skip
    g.add_argument("--heartbeat-interval", type=float, default=1.0, metavar="SECONDS")
    g.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="how long SIGTERM waits for in-flight requests")  # fmt: skip
    g.add_argument("--log-level", default="INFO")

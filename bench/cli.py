"""The bench package's subcommands of the ``pdserve`` command line: ``bench`` (load-test
an OpenAI-compatible server), ``plan`` (size prefill/decode workers) and ``chaos`` (serve
through injected faults and kills, and check nothing hung, leaked or changed).
``pdserve/cli.py`` adds them next to the service commands."""

from __future__ import annotations

import argparse
from typing import Any

from bench.chaos import cli as chaos_cli
from bench.plan import cli as plan_cli
from bench.serve import cli as serve_cli


def add_commands(sub: Any) -> None:
    """Add ``bench``, ``plan`` and ``chaos`` to ``sub`` (``ArgumentParser.add_subparsers()``)."""
    bench = sub.add_parser("bench", help="load-test an OpenAI-compatible server",
                           description=serve_cli.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    serve_cli.add_bench_flags(bench)
    bench.set_defaults(func=serve_cli.run_bench)
    plan = sub.add_parser("plan", help="size prefill/decode workers (or `plan profile`)",
                          description=plan_cli.__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    plan_cli.add_plan_flags(plan)
    plan.set_defaults(func=plan_cli.run_plan)
    chaos = sub.add_parser("chaos", help="serve through injected faults and kills, and check",
                           description=chaos_cli.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    chaos_cli.add_chaos_flags(chaos)
    chaos.set_defaults(func=chaos_cli.run_chaos)

"""The ``pdserve`` command line.

Subcommands:
  generate   run the colocated engine in this process and stream one completion
  up         start the local stack (redis, scheduler, workers, gateway) as processes
  bench      load-test an OpenAI-compatible server (TTFT, ITL, throughput, goodput)
  plan       size prefill/decode workers for a workload from a measured profile
  chaos      serve through injected faults and kills; check nothing hung, leaked or changed
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from bench.cli import add_commands as add_bench_commands
from services import cli as services_cli


def build_parser() -> argparse.ArgumentParser:
    # generate and up come from services/cli.py, bench and plan from bench/cli.py: this
    # module composes them, so neither package imports the other's commands.
    return services_cli.build_parser(__doc__, [add_bench_commands])


def main(argv: Sequence[str] | None = None) -> int:
    return services_cli.run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())

"""``python -m bench.chaos``: the same as ``pdserve chaos``."""

import sys

from bench.chaos.cli import build_parser, run_chaos

if __name__ == "__main__":
    sys.exit(run_chaos(build_parser().parse_args()))

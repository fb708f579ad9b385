"""``python -m bench.serve``: the same as ``pdserve bench``."""

import sys

from bench.serve.cli import build_parser, run_bench

if __name__ == "__main__":
    sys.exit(run_bench(build_parser().parse_args()))

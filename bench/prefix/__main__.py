"""``python -m bench.prefix``: see ``bench/prefix/cli.py``."""

import sys

from bench.prefix.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m bench.plan``: the same as ``pdserve plan``."""

import sys

from bench.plan.cli import main

sys.exit(main())

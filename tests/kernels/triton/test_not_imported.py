"""The CPU engine and the services never import triton: it is a test dependency only."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

# Every module of the serving packages except the Triton kernels themselves; then, as a
# control that the check can see triton at all, one kernel module (where triton exists).
_PROBE = """
import importlib, json, pkgutil, sys
imported = []
for pkg in ("engine", "services", "transfer", "kernels", "pdserve"):
    for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
        if not info.name.startswith("kernels.triton"):
            importlib.import_module(info.name)
            imported.append(info.name)
before = "triton" in sys.modules
control = None
if sys.argv[1] == "control":
    importlib.import_module("kernels.triton.kv_store")
    control = "triton" in sys.modules
print(json.dumps({"imported": imported, "triton": before, "control": control}))
"""


def test_serving_packages_do_not_import_triton() -> None:
    control = "control" if importlib.util.find_spec("triton") else "none"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, control],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"engine.attention", "engine.model_runner", "services.decode.server"} <= set(
        result["imported"]
    )
    assert result["triton"] is False
    if control == "control":
        assert result["control"] is True

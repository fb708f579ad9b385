#!/usr/bin/env bash
# Build the compose stack's images offline: no registry, no network inside a build.
#   bash compose/build.sh            base images (cached), wheelhouse (cached), pdserve:dev
#   bash compose/build.sh --base     only the two base images
# 1. Base images from Debian packages on the host: mmdebstrap writes a minimal bookworm root
#    file system and `docker import` turns it into an image. One has Python 3.11 with a C++
#    compiler (the CPU kernels compile at image build), one has redis-server. Each carries a
#    label with the digest of what it was made from, so a rebuild happens only when that
#    changes.
# 2. A wheelhouse (compose/.wheelhouse, ignored by git) of exactly the versions installed on
#    this machine, for the base image's Python (compose/wheelhouse.py): the image runs what
#    the tests ran.
# 3. `docker build` of compose/Dockerfile, which installs from the wheelhouse with --no-index.
# Needs: a running Docker engine, mmdebstrap, pip (Debian: apt-get install docker.io
# docker-compose mmdebstrap; compose/test.sh installs and starts them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SUITE=bookworm

PYTHON_BASE=pdserve/python:bookworm
# Mooncake's Transfer Engine links libibverbs (even over TCP; ibverbs-providers: the NICs'
# drivers, for RDMA), libnuma and libcurl.
PYTHON_PACKAGES=python3,python3-venv,python3-dev,g++,ca-certificates,libibverbs1,ibverbs-providers,libnuma1,libcurl4
REDIS_BASE=pdserve/redis:bookworm
REDIS_PACKAGES=redis-server
PROMETHEUS_BASE=pdserve/prometheus:bookworm  # the compose profile `monitoring`
PROMETHEUS_PACKAGES=prometheus

# base_image TAG PACKAGES CMD: make TAG from Debian's packages unless it already exists with
# the same recipe.
base_image() {
  local tag=$1 packages=$2 cmd=$3
  local recipe="$SUITE minbase $packages $cmd"
  local digest
  digest=$(printf '%s' "$recipe" | sha256sum | cut -c1-16)
  if [[ $(docker image inspect -f '{{index .Config.Labels "pdserve.recipe"}}' "$tag" 2>/dev/null) == "$digest" ]]; then
    echo "build: $tag is up to date ($digest)"
    return
  fi
  echo "build: making $tag from Debian $SUITE: $packages"
  mmdebstrap --quiet --variant=minbase --include="$packages" \
    --customize-hook='rm -rf "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/*' \
    "$SUITE" - \
    | docker import --change "LABEL pdserve.recipe=$digest" --change "CMD $cmd" - "$tag" >/dev/null
}

base_image "$PYTHON_BASE" "$PYTHON_PACKAGES" '["python3"]'
base_image "$REDIS_BASE" "$REDIS_PACKAGES" '["redis-server"]'
base_image "$PROMETHEUS_BASE" "$PROMETHEUS_PACKAGES" '["prometheus"]'
[[ "${1:-}" == "--base" ]] && exit 0

$PY compose/wheelhouse.py compose/.wheelhouse "$PYTHON_BASE"
docker build --quiet --force-rm -f compose/Dockerfile --build-arg BASE_IMAGE="$PYTHON_BASE" -t pdserve:dev . >/dev/null
echo "build: pdserve:dev ($(docker image inspect -f '{{.Size}}' pdserve:dev | awk '{printf "%.0f MB", $1/1e6}'))"

#!/usr/bin/env bash
# Regenerate the Python stubs of protos/pdserve/v1/*.proto into pdserve/v1/ (idempotent).
# The generated files are committed; tests/protos/test_protos.py fails when they are stale.
# Run after every .proto edit, with the pinned grpcio-tools (its bundled protoc decides the
# exact bytes of the output).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# Remove the old output first so a deleted or renamed .proto leaves no orphan module.
rm -f pdserve/v1/*_pb2.py pdserve/v1/*_pb2.pyi pdserve/v1/*_pb2_grpc.py
$PY -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. \
  protos/pdserve/v1/*.proto

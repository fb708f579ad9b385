#!/usr/bin/env bash
# Install pdserve, start the local disaggregated stack on the embedded default model
# (redis-server, scheduler, 1 prefill + 1 decode worker, gateway), send one real streaming
# chat request through the OpenAI-compatible gateway, print the answer, and stop.
#   bash scripts/run.sh                       the default question
#   bash scripts/run.sh "Name three planets."  your question
# To keep the stack running instead: pdserve up   (Ctrl-C stops it)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
question=${1:-"What is the capital of France?"}
exec "${PYTHON:-python3}" -m pdserve.cli up --smoke "$question" --http-port 0 --grpc-port 0

#!/usr/bin/env bash
# Install pdserve, then stream a real answer from the embedded default model.
# Extra arguments replace the question, e.g.: bash scripts/run.sh "Name three planets."
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
question=${1:-"What is the capital of France?"}
exec "${PYTHON:-python3}" -m services.cli generate --chat "$question" --max-tokens 64

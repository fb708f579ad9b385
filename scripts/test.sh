#!/usr/bin/env bash
# Install everything the tests need, then run them. Extra arguments go to pytest.
#   bash scripts/test.sh                 the default (CI) suite, then the compose stack in
#                                        Docker (compose/test.sh; PDSERVE_SKIP_COMPOSE=1
#                                        leaves it out)
#   bash scripts/test.sh -m slow         only the slow tests (arguments: pytest only)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

bash scripts/setup.sh --test

$PY -m ruff check .
$PY -m ruff format --check .

set +e
$PY -m pytest -m "not slow and not compose" --durations=40 "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
[[ $rc -ne 0 ]] && exit $rc
if [[ $# -eq 0 && "${PDSERVE_SKIP_COMPOSE:-0}" != 1 ]]; then
  bash compose/test.sh
fi

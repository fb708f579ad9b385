#!/usr/bin/env bash
# Run the compose stack for real: install and start a Docker engine if none answers, build
# the images offline (compose/build.sh), then `pytest -m compose` (tests/compose/
# test_live_stack.py: up, OpenAI SDK, scale decode 2 -> 3, a decode crash mid-stream, down).
# Leaves no container, network or volume of the test project, and stops the daemon if it
# started it. Images stay cached for the next run.
#   bash compose/test.sh        (as root, or with sudo; on Debian/Ubuntu)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SUDO=""
[[ $(id -u) -eq 0 ]] || SUDO=sudo
start=$(date +%s)

need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 || need+=(docker-compose)
command -v mmdebstrap >/dev/null 2>&1 || need+=(mmdebstrap)
if ((${#need[@]})); then
  echo "compose/test.sh: installing ${need[*]}"
  ($SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}") >/dev/null
fi

daemon_pid=""
stop_daemon() {
  if [[ -n "$daemon_pid" ]]; then
    $SUDO kill "$daemon_pid" 2>/dev/null || true
    for _ in $(seq 60); do $SUDO kill -0 "$daemon_pid" 2>/dev/null || break; sleep 1; done
    echo "compose/test.sh: stopped the Docker daemon it started"
  fi
}
trap stop_daemon EXIT
if ! docker info >/dev/null 2>&1; then
  log=$(mktemp -t dockerd.XXXXXX.log)
  $SUDO dockerd >"$log" 2>&1 &
  daemon_pid=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { echo "compose/test.sh: dockerd did not start:"; tail -20 "$log"; exit 1; }
fi

bash compose/build.sh
set +e
$PY -m pytest -m compose tests/compose/test_live_stack.py -p no:cacheprovider "$@"
rc=$?
set -e
[[ $rc -eq 5 ]] && { echo "compose/test.sh: no compose test ran: failing on purpose" >&2; rc=1; }
echo "compose/test.sh: exit $rc after $(($(date +%s) - start)) s"
exit $rc

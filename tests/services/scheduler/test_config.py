"""SchedulerConfig: flags and env vars by the shared rule, precedence, validation, --help."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.scheduler.config import SchedulerConfig, load_config
from tests.services.scheduler.processes import REPO


def test_flag_beats_env_beats_default() -> None:
    env = {"PDSERVE_SCHEDULER_GRPC_PORT": "6000", "PDSERVE_SCHEDULER_HEARTBEAT_TTL_S": "2.5"}
    assert load_config([], env) == SchedulerConfig(grpc_port=6000, heartbeat_ttl_s=2.5)
    config = load_config(["--grpc-port", "7000", "--max-inflight", "9"], env)
    assert (config.grpc_port, config.heartbeat_ttl_s, config.max_inflight) == (7000, 2.5, 9)
    assert load_config([], {}) == SchedulerConfig()


def test_derived_values() -> None:
    config = SchedulerConfig(heartbeat_ttl_s=1.0, heartbeats_per_ttl=4, max_inflight=3)
    assert config.heartbeat_interval_ms == 250
    state = config.state_config()
    assert state.lease_ttl_s == 1.0 and state.limits.max_inflight == 3
    assert state.limits.retry_after_ms == 250


@pytest.mark.parametrize(
    "argv",
    [
        ["--heartbeat-ttl-s", "0"],
        ["--grpc-port", "70000"],
        ["--queue-size", "x"],
        ["--log-level", "loud"],
        ["--heartbeat-ttl", "3"],  # durations keep their unit in the flag
    ],
)
def test_bad_values_exit_with_usage_error(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        load_config(argv, {})
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_bad_env_value_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        load_config([], {"PDSERVE_SCHEDULER_QUEUE_SIZE": "many"})


def test_module_help_lists_every_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.scheduler", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    for flag in ("--grpc-port", "--metrics-port", "--redis-url", "--heartbeat-ttl-s",
                 "--queue-size", "--drain-timeout-s"):  # fmt: skip
        assert flag in out

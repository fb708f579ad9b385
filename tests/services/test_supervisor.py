"""``pdserve up``'s supervisor on real (tiny) processes: a dead restartable process comes back
after its backoff, within its budget; anything else stops the stack with the reason."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from services.launcher import Proc, Stack
from services.supervisor import RestartPolicy, Supervisor

# Prints its READY line, then exits with status 3.
_DIES = [sys.executable, "-c", "import sys; print('READY x 127.0.0.1:1', flush=True); sys.exit(3)"]
_LIVES = [
    sys.executable,
    "-c",
    "import time; print('READY y 127.0.0.1:2', flush=True); time.sleep(60)",
]


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _exited(proc: Proc) -> None:
    assert proc.popen is not None
    proc.popen.wait(10)


def test_the_delay_doubles_up_to_its_cap_and_only_restarts_in_the_window_count() -> None:
    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=3.0, budget=5, window_s=60)
    assert [policy.delay(n) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert policy.recent([0.0, 10.0, 50.0], now=69.0) == 2  # 0.0 is out of the window
    with pytest.raises(ValueError):
        RestartPolicy(first_delay_s=2.0, max_delay_s=1.0)


def test_a_dead_process_is_restarted_after_its_backoff_until_its_budget_is_spent(
    tmp_path: Path,
) -> None:
    stack = Stack(log_dir=tmp_path)
    clock, said = _Clock(), []
    policy = RestartPolicy(first_delay_s=1.0, max_delay_s=4.0, budget=2, window_s=60)
    supervisor = Supervisor(stack, {"x"}, policy, said.append, clock)
    try:
        dies = stack.start(Proc("x", _DIES))
        stack.start(Proc("y", _LIVES))
        stack.wait_ready(stack.procs, 30)
        pids = [dies.popen.pid]  # type: ignore[union-attr]
        for delay in (1.0, 2.0):
            _exited(dies)
            assert supervisor.tick() is None  # the restart is scheduled, not done yet
            assert "x exited (3); restarting it in" in said[-1]
            clock.now += delay - 0.01
            assert supervisor.tick() is None and dies.popen.pid == pids[-1]  # type: ignore[union-attr]
            clock.now += 0.02
            assert supervisor.tick() is None
            assert dies.popen.pid != pids[-1]  # type: ignore[union-attr]
            pids.append(dies.popen.pid)  # type: ignore[union-attr]
            stack.wait_ready([dies], 30)  # the same command line, ready again
        _exited(dies)
        reason = supervisor.tick()
        assert reason is not None and "after 2 restarts within 60 s" in reason
        # The budget is per window: restarts older than it no longer count.
        clock.now += 61
        assert supervisor.tick() is None and "restarting it in 1.0 s" in said[-1]
        assert (tmp_path / "x.log").read_text().count("READY x") == 3  # one log, appended
    finally:
        stack.stop(grace=2)


def test_a_process_that_is_not_restartable_stops_the_stack_with_the_reason(
    tmp_path: Path,
) -> None:
    stack = Stack(log_dir=tmp_path)
    supervisor = Supervisor(stack, set(), RestartPolicy(), print, _Clock())
    try:
        proc = stack.start(Proc("scheduler", _DIES))
        stack.wait_ready([proc], 30)
        _exited(proc)
        assert supervisor.tick() == "scheduler exited (3); it is not restarted, so the stack stops"
    finally:
        stack.stop(grace=2)


def test_a_worker_past_its_budget_is_given_up_on_and_the_rest_keep_serving(
    tmp_path: Path,
) -> None:
    stack = Stack(log_dir=tmp_path)
    clock, said = _Clock(), []
    policy = RestartPolicy(first_delay_s=0.0, max_delay_s=0.0, budget=1, window_s=60)
    supervisor = Supervisor(stack, {"decode-0", "gateway"}, policy, said.append, clock,
                            essential={"gateway"})  # fmt: skip
    try:
        worker = stack.start(Proc("decode-0", _DIES))
        gateway = stack.start(Proc("gateway", _DIES))
        stack.wait_ready(stack.procs, 30)
        _exited(worker)
        _exited(gateway)
        assert supervisor.tick() is None  # both restart once
        stack.wait_ready(stack.procs, 30)
        _exited(worker)
        _exited(gateway)
        reason = supervisor.tick()
        assert reason == "gateway exited (3) after 1 restarts within 60 s; stopping"
        assert supervisor.given_up == {"decode-0"}
        assert "decode-0 exited (3) after 1 restarts within 60 s; giving up on it" in said[-1]
        assert supervisor.tick() is not None  # the gateway still stops it; decode-0 is left
        assert supervisor.given_up == {"decode-0"}
    finally:
        stack.stop(grace=2)

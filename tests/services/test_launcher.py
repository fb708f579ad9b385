"""``services.launcher.Stack``: a process's log rotates at its size limit (one older file is
kept), and every process dies with the process that started it."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from services import launcher
from services.launcher import Proc, Stack

_SCRIPT = "print('READY z 127.0.0.1:3', flush=True)\nfor i in range(400): print('x' * 99)"
_CHATTY = [sys.executable, "-c", _SCRIPT]


def test_a_log_rotates_at_its_limit_keeping_one_older_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launcher, "MAX_LOG_BYTES", 10_000)
    stack = Stack(log_dir=tmp_path)
    try:
        proc = stack.start(Proc("z", _CHATTY))
        assert proc.popen is not None
        proc.popen.wait(30)
        deadline = time.monotonic() + 10
        while len(proc.lines) < 200 and time.monotonic() < deadline:  # the pump caught up
            time.sleep(0.05)
        current, older = tmp_path / "z.log", tmp_path / "z.log.1"
        assert older.exists() and 0 < current.stat().st_size <= 10_100
        assert 10_000 < older.stat().st_size <= 10_100
        # 40 KB written: the oldest rotations are gone, the newest lines are in z.log
        assert current.read_text().splitlines()[-1] == "x" * 99
    finally:
        stack.stop(grace=2)

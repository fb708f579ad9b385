"""Start real service processes for integration tests, and always stop them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass
class ServiceProcess:
    name: str
    proc: subprocess.Popen[str]
    address: str = ""
    output: list[str] = field(default_factory=list)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, wait, then SIGKILL; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def start_service(module: str, *args: str, ready_timeout: float = 120.0) -> ServiceProcess:
    """Run ``python -m module args`` and wait for its ``READY <role> <address>`` line."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    sp = ServiceProcess(module, proc)
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            sp.output.append(line)
            if line.startswith("READY ") and not ready.is_set():
                sp.address = line.split()[2]
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + ready_timeout
    while not ready.wait(0.1):
        if proc.poll() is not None or time.monotonic() > deadline:
            sp.kill()
            tail = "".join(sp.output[-30:])
            raise RuntimeError(f"{module} did not become ready:\n{tail}")
    return sp

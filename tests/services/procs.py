"""Start real service processes for integration tests, and always stop them.

A thin test-side face of ``services/launcher.py`` (the code ``pdserve up`` uses), so the
tests start services exactly the way users do.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from services.launcher import Proc, Stack, py

REPO = Path(__file__).resolve().parents[2]


@dataclass
class ServiceProcess:
    stack: Stack
    handle: Proc

    @property
    def address(self) -> str:
        return self.handle.address

    @property
    def proc(self):  # the subprocess.Popen
        assert self.handle.popen is not None
        return self.handle.popen

    @property
    def ready_line(self) -> str:
        """The ``READY ...`` line the service printed."""
        return self.handle.ready_text

    @property
    def output(self) -> list[str]:
        """The process's most recent output lines."""
        return self.handle.lines

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM (the service drains), wait, then SIGKILL; returns the exit code."""
        self.stack.stop(grace=timeout)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def start_service(
    module: str,
    *args: str,
    ready_timeout: float = 120.0,
    env: dict[str, str] | None = None,
    insecure: bool = False,
) -> ServiceProcess:
    """Run ``python -m module args`` (``env``: more environment) and wait for its
    ``READY <role> <address>`` line. The service shares the test session's cluster token
    (tests/conftest.py); ``insecure``: it runs without one (``--insecure-cluster``: no
    internal call or placement is checked), for workers driven without a scheduler."""
    env = dict(env or {})
    if insecure:
        env["PDSERVE_INSECURE_CLUSTER"] = "true"
    stack = Stack(log_dir=Path(tempfile.mkdtemp(prefix="pdserve-test-")), env=env)
    handle = stack.start(Proc(module.rsplit(".", 1)[-1], py(module, *args)))
    try:
        stack.wait_ready([handle], ready_timeout)
    except RuntimeError:
        stack.stop(grace=2.0)
        raise
    return ServiceProcess(stack, handle)


def start_unscheduled(module: str, *args: str, **kw: object) -> ServiceProcess:
    """``start_service`` for workers a test drives without a scheduler: nothing would sign
    their placement tokens, so they run as an insecure cluster (the token and placement
    checks are tested with a scheduler, in test_cluster_auth_e2e.py)."""
    return start_service(module, *args, insecure=True, **kw)  # type: ignore[arg-type]

"""A real ``mooncake_master`` for tests: a private one on free ports, its log in a temp dir.

master = MooncakeMaster.start()
... MooncakeOptions(master=master.address, ...)
master.kill(); master.restart()  # a crash, then an empty master on the same port
master.stop()
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvstore.master import READY_LINE, master_argv


def free_port() -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class MooncakeMaster:
    port: int
    argv: list[str]
    directory: Path
    process: subprocess.Popen[bytes]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @classmethod
    def start(cls, *, ssd: bool = False, timeout_s: float = 15.0) -> MooncakeMaster:
        directory = Path(tempfile.mkdtemp(prefix="pdserve-mooncake-"))
        port = free_port()
        argv = master_argv(port, metrics_port=free_port(), host="127.0.0.1", ssd=ssd)
        master = cls(port, argv, directory, cls._spawn(argv, directory))
        master._wait_ready(timeout_s)
        return master

    @staticmethod
    def _spawn(argv: list[str], directory: Path) -> subprocess.Popen[bytes]:
        with open(directory / "master.log", "ab") as log:  # the child keeps its own copy
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def _wait_ready(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and self.process.poll() is None:
            if READY_LINE in self.log():
                return
            time.sleep(0.05)
        raise RuntimeError(f"mooncake_master did not start:\n{self.log()[-2000:]}")

    def log(self) -> str:
        return (self.directory / "master.log").read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: every object's metadata is gone with it."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=5)

    def restart(self, timeout_s: float = 15.0) -> None:
        assert self.process.poll() is not None, "the master is still running"
        (self.directory / "master.log").write_text("")
        self.process = self._spawn(self.argv, self.directory)
        self._wait_ready(timeout_s)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        shutil.rmtree(self.directory, ignore_errors=True)

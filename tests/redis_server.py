"""A real redis-server for tests: a private instance on a free port, in a temp directory.

Persistence is off (``--save ""``, ``--appendonly no``) so nothing outlives the instance. Use
``RedisServer.start()`` directly (a context manager) or make a pytest fixture with
``redis_server_fixture()``::

    # conftest.py
    from tests.redis_server import redis_server_fixture

    redis_server = redis_server_fixture(scope="module")

    def test_it(redis_server):
        client = redis.Redis.from_url(redis_server.url)
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

DEFAULT_BINARY = "redis-server"
_START_ATTEMPTS = 3


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free a moment ago (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ping(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisServer:
    """One running redis-server process; ``stop()`` ends it and removes its directory."""

    host: str
    port: int
    process: subprocess.Popen[bytes]
    directory: Path
    argv: list[str]

    @property
    def url(self) -> str:
        """``redis://host:port/0`` of this instance."""
        return f"redis://{self.host}:{self.port}/0"

    @classmethod
    def start(
        cls, *, binary: str = DEFAULT_BINARY, host: str = "127.0.0.1", timeout_s: float = 10.0
    ) -> RedisServer:
        """Start redis-server and return once it answers PING.

        Raises ``FileNotFoundError`` when the binary is missing and ``RuntimeError`` when the
        server does not answer within ``timeout_s`` (its log tail is in the message).
        """
        path = shutil.which(binary) or (binary if Path(binary).exists() else None)
        if path is None:
            raise FileNotFoundError(f"redis-server binary not found: {binary}")
        last_error = ""
        # The free port can be taken between probing and binding; a fresh port fixes that.
        for _ in range(_START_ATTEMPTS):
            directory = Path(tempfile.mkdtemp(prefix="pdserve-redis-"))
            port = free_port(host)
            options = {
                "port": str(port),
                "bind": host,
                "dir": str(directory),
                "save": "",
                "appendonly": "no",
                "daemonize": "no",
                "protected-mode": "no",
                "logfile": str(directory / "redis.log"),
            }
            argv = [path]
            for name, value in options.items():
                argv += [f"--{name}", value]
            process = _spawn(argv)
            server = cls(host=host, port=port, process=process, directory=directory, argv=argv)
            if server._answers_within(timeout_s):
                return server
            last_error = server._log_tail()
            server.stop()
        raise RuntimeError(f"redis-server did not answer PING within {timeout_s}s:\n{last_error}")

    def _answers_within(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            if _ping(self.host, self.port, timeout_s=0.5):
                return True
            time.sleep(0.02)
        return False

    def kill(self) -> None:
        """SIGKILL the server (a crash: it keeps nothing); ``restart`` brings it back."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=5)

    def restart(self, timeout_s: float = 10.0) -> None:
        """Start a dead server again, empty, on the same port; return once it answers PING."""
        assert self.process.poll() is not None, "redis-server is still running"
        self.process = _spawn(self.argv)
        if not self._answers_within(timeout_s):
            raise RuntimeError(f"redis-server did not come back on :{self.port}")

    def _log_tail(self) -> str:
        try:
            return (self.directory / "redis.log").read_text()[-2000:]
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the server (kill it after ``timeout_s``) and delete its directory."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout_s)
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _spawn(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def redis_server_fixture(scope: Any = "session") -> Callable[..., Iterator[RedisServer]]:
    """Return a pytest fixture yielding a fresh ``RedisServer`` per ``scope``.

    Assign it to a name in a test module or conftest; that name becomes the fixture.
    """

    @pytest.fixture(scope=scope)
    def _redis_server() -> Iterator[RedisServer]:
        with RedisServer.start() as server:
            yield server

    return _redis_server

"""``pdserve up``: the whole stack as local processes, each service its own process.

Order: redis-server -> scheduler -> prefill workers -> decode workers -> gateway. Each
process prints ``READY <role> <address>`` when it serves; ``up`` waits for every one (with
a deadline), prints the endpoints, and on Ctrl-C / SIGTERM stops them in reverse order
(SIGTERM, which drains, then SIGKILL after a grace period longer than the drain).

Every process dies with the one that started it: each child asks the kernel for SIGKILL
when its parent goes (``PR_SET_PDEATHSIG``), so a ``kill -9`` of ``pdserve up`` leaves no
service holding its ports or writing to a dead pipe. The kernel ties that signal to the
*thread* that forked the child: a ``Stack`` starts and restarts its processes from one
thread that lives as long as the stack (``pdserve up``'s main thread). Each process's log
rotates at ``MAX_LOG_BYTES`` (the current file and one older, ``.log.1``).
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

READY_TIMEOUT_S = 180.0
# The workers drain for 30 s on SIGTERM (--drain-timeout-s): stopping waits longer than that.
STOP_GRACE_S = 35.0
MAX_LOG_BYTES = 64 << 20
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """In a child, before exec: SIGKILL when the parent dies; exits now if it already did."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died between fork and prctl
        os._exit(1)


@dataclass
class Proc:
    name: str
    argv: list[str]
    cpus: set[int] | None = None
    popen: subprocess.Popen[str] | None = None
    address: str = ""
    ready_text: str = ""
    ready: threading.Event = field(default_factory=threading.Event)
    ready_line: str | None = "READY "  # what marks it ready (None: ready once started)
    lines: list[str] = field(default_factory=list)


# How a service learns to authenticate internal calls (services/common/cluster_auth.py).
_AUTH_VARIABLES = (
    "PDSERVE_CLUSTER_TOKEN",
    "PDSERVE_CLUSTER_TOKEN_FILE",
    "PDSERVE_INSECURE_CLUSTER",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Stack:
    """Starts and stops a set of processes; the owner of their lifetimes."""

    def __init__(
        self, *, log_dir: Path, echo: bool = False, env: dict[str, str] | None = None
    ) -> None:
        """``env``: variables every process gets on top of this one's environment. How
        internal calls authenticate (a cluster token, its file, or
        ``PDSERVE_INSECURE_CLUSTER``) comes from ``env`` alone when it says, else from this
        process's environment, else the stack makes a fresh token of its own for all its
        processes: services refuse to start without one."""
        self.procs: list[Proc] = []
        self.log_dir = log_dir
        self.echo = echo
        self.env: dict[str, str] = dict(env or {})
        seen = {**os.environ, **self.env}
        if not any(seen.get(k) for k in _AUTH_VARIABLES):
            self.env["PDSERVE_CLUSTER_TOKEN"] = secrets.token_urlsafe(32)

    def start(self, proc: Proc, *, ready_line: str | None = "READY ") -> Proc:
        """Start ``proc``; it is ready once a line containing ``ready_line`` appears (our
        services print ``READY <role> <address>``)."""
        proc.ready_line = ready_line
        self.procs.append(proc)
        self._spawn(proc, "w")
        return proc

    def restart(self, proc: Proc) -> None:
        """Start ``proc`` (which has exited) again with the same command line; its log
        continues in the same file."""
        assert proc.popen is not None and proc.popen.poll() is not None, f"{proc.name} runs"
        proc.ready.clear()
        proc.address = proc.ready_text = ""
        proc.lines.clear()
        self._spawn(proc, "a")

    def named(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def _environment(self) -> dict[str, str]:
        inherited = dict(os.environ)
        if any(k in self.env for k in _AUTH_VARIABLES):  # the stack's choice, not a mix
            for k in _AUTH_VARIABLES:
                inherited.pop(k, None)
        return {**inherited, **self.env, "PYTHONUNBUFFERED": "1"}

    def _spawn(self, proc: Proc, log_mode: str) -> None:
        parent = os.getpid()

        def pin() -> None:
            _die_with_parent(parent)
            if proc.cpus:
                os.sched_setaffinity(0, proc.cpus)

        path = self.log_dir / f"{proc.name}.log"
        log = open(path, log_mode)
        proc.popen = subprocess.Popen(
            proc.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=pin,
            env=self._environment(),
        )
        popen, ready_line = proc.popen, proc.ready_line

        def pump() -> None:
            nonlocal log
            assert popen.stdout is not None
            try:
                for line in popen.stdout:
                    log.write(line)
                    log.flush()
                    if log.tell() > MAX_LOG_BYTES:  # rotate: the pump owns the file
                        log.close()
                        path.replace(path.with_suffix(".log.1"))
                        log = open(path, "w")
                    proc.lines.append(line)
                    del proc.lines[:-200]
                    if self.echo:
                        sys.stderr.write(f"[{proc.name}] {line}")
                    if ready_line and ready_line in line and not proc.ready.is_set():
                        parts = line.split()
                        if line.startswith("READY ") and len(parts) > 2:
                            proc.address = parts[2]
                        proc.ready_text = line.strip()
                        proc.ready.set()
            finally:
                log.close()

        threading.Thread(target=pump, name=f"log-{proc.name}", daemon=True).start()
        if ready_line is None:
            proc.ready.set()

    def wait_ready(self, procs: Sequence[Proc], timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        for p in procs:
            while not p.ready.wait(0.1):
                assert p.popen is not None
                if p.popen.poll() is not None:
                    raise RuntimeError(
                        f"{p.name} exited ({p.popen.returncode}):\n{''.join(p.lines)}"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{p.name} not ready after {timeout:.0f}s:\n{''.join(p.lines)}"
                    )

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        for p in reversed(self.procs):
            if p.popen is not None and p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in reversed(self.procs):
            if p.popen is None:
                continue
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.popen.kill()
                p.popen.wait(5)

    def dead(self) -> list[Proc]:
        return [p for p in self.procs if p.popen is not None and p.popen.poll() is not None]


REDIS_USER = "pdserve"
REDIS_MAXMEMORY = "256mb"


def redis_password_file(workdir: Path) -> Path:
    """Where ``redis_proc`` keeps the stack's Redis password (mode 0600)."""
    return workdir / "redis" / "password"


def redis_proc(port: int, workdir: Path) -> Proc:
    """redis-server on ``port``, persisting to an append-only file under ``workdir/redis``
    (fsync once a second), so a restarted Redis still has the request records.

    Only the ACL user ``REDIS_USER`` may log in, with a random password kept in
    ``redis_password_file(workdir)`` (made once: a restart keeps it); the default user is
    off. Memory is capped at ``REDIS_MAXMEMORY``, evicting the least recently used keys
    (every key the scheduler writes is a cache or a record with a TTL), so a flood of
    records cannot grow Redis until the host kills it."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (bash scripts/setup.sh installs it)")
    data = workdir / "redis"
    data.mkdir(parents=True, exist_ok=True)
    password = redis_password_file(workdir)
    if not password.exists():
        _private(password, secrets.token_urlsafe(32))
    acl = data / "users.acl"
    _private(acl, f"user default off\nuser {REDIS_USER} on >{password.read_text()} ~* &* +@all\n")
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(data),
            "--aclfile", str(acl), "--maxmemory", REDIS_MAXMEMORY,
            "--maxmemory-policy", "allkeys-lru"]  # fmt: skip
    return Proc("redis", argv)


def _private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable by this user only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def py(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def default_log_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="pdserve-"))

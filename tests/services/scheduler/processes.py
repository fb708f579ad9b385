"""Real processes for the scheduler's integration tests: the scheduler and fake workers.

A fake worker (``python -m tests.services.scheduler.processes worker ...``) is a real
client of the real scheduler: it registers, heartbeats its (fixed) load and prefix cache on
the interval the scheduler asks for, and prints ``READY worker <id>`` after its first
successful heartbeat. Tests SIGKILL it to play a crashed worker.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]


@dataclass
class Process:
    """A child process whose stdout lines are collected by a thread."""

    proc: subprocess.Popen[str]
    log_path: Path
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    address: str = ""

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text()[-4000:]
        except OSError:
            return ""

    def terminate(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, wait up to ``timeout_s`` (then SIGKILL); return the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: a crash, no cleanup of any kind."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


def spawn(args: Sequence[str], ready_timeout_s: float = 30.0) -> Process:
    """Run ``python args`` from the repo root and wait for its ``READY <kind> <name>`` line."""
    log = Path(tempfile.mkstemp(prefix="pdserve-test-", suffix=".log")[1])
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, *args],
            cwd=REPO,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    p = Process(proc, log)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            p.lines.append(line)
            if line.startswith("READY ") and not p.ready.is_set():
                p.address = line.split()[2]
                p.ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + ready_timeout_s
    while not p.ready.wait(0.05):
        if proc.poll() is not None or time.monotonic() > deadline:
            p.kill()
            raise RuntimeError(f"{args} did not become ready:\n{p.log_tail()}")
    return p


def start_scheduler(*flags: str) -> Process:
    """``python -m services.scheduler flags``; ``address`` is its gRPC host:port."""
    return spawn(["-m", "services.scheduler", *flags])


def start_worker(
    scheduler: str,
    worker_id: str,
    role: str,
    *,
    free_kv_blocks: int = 1000,
    cached: Sequence[int] = (),
) -> Process:
    """A fake worker process heartbeating to ``scheduler``."""
    args = ["-m", "tests.services.scheduler.processes", "worker", scheduler, worker_id, role]
    args += ["--free-kv-blocks", str(free_kv_blocks)]
    if cached:
        args += ["--cached", ",".join(str(h) for h in cached)]
    return spawn(args)


# ---- the fake worker process ----


def worker_info(worker_id: str, role: int, grpc_address: str = "127.0.0.1:1") -> Any:
    """A test worker's ``WorkerInfo`` (1,000 blocks of 16 tokens, model "m")."""
    from pdserve.v1 import common_pb2

    return common_pb2.WorkerInfo(
        worker_id=worker_id,
        role=role,
        grpc_address=grpc_address,
        transports=["tcp"],
        model="m",
        host_id="test-host",
        capacity=common_pb2.WorkerCapacity(
            total_kv_blocks=1000,
            block_size=16,
            max_num_seqs=64,
            max_model_len=8192,
            max_num_batched_tokens=2048,
        ),
    )


def _worker_main(argv: Sequence[str]) -> int:
    import grpc

    from pdserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
    from services.common.cluster_auth import TOKEN_METADATA_KEY

    parser = argparse.ArgumentParser()
    parser.add_argument("scheduler")
    parser.add_argument("worker_id")
    parser.add_argument("role", choices=["prefill", "decode", "colocated"])
    parser.add_argument("--free-kv-blocks", type=int, default=1000)
    parser.add_argument("--cached", default="")
    args = parser.parse_args(argv)
    cached = [int(h) for h in args.cached.split(",") if h]
    role = getattr(common_pb2, f"WORKER_ROLE_{args.role.upper()}")
    info = worker_info(args.worker_id, role, f"127.0.0.1:{40000 + os.getpid() % 20000}")
    load = scheduler_pb2.LoadSnapshot(free_kv_blocks=args.free_kv_blocks, total_kv_blocks=1000)
    # the token this process inherited from the test session (tests/conftest.py)
    token = ((TOKEN_METADATA_KEY, os.environ["PDSERVE_CLUSTER_TOKEN"]),)
    with grpc.insecure_channel(args.scheduler) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        lease = stub.RegisterWorker(
            scheduler_pb2.RegisterWorkerRequest(worker=info), timeout=5, metadata=token
        )
        interval_s = lease.heartbeat_interval_ms / 1000
        sequence = 0
        snapshot = True
        while True:
            reply = stub.Heartbeat(
                scheduler_pb2.HeartbeatRequest(
                    worker_id=args.worker_id,
                    state=scheduler_pb2.WORKER_STATE_SERVING,
                    sequence=sequence,
                    load=load,
                    cached_block_hashes_added=cached if snapshot else [],
                    cache_snapshot=snapshot,
                ),
                timeout=5,
                metadata=token,
            )
            if sequence == 0:
                print(f"READY worker {args.worker_id}", flush=True)
            sequence += 1
            snapshot = reply.resync_cache
            time.sleep(interval_s)


if __name__ == "__main__":
    if sys.argv[1:2] != ["worker"]:
        sys.exit("usage: python -m tests.services.scheduler.processes worker ...")
    sys.exit(_worker_main(sys.argv[2:]))

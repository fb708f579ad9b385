"""``pdserve up``'s config and layout: pinned by default (the measured-best layout),
decode workers first and away from the control plane, engine settings handed to the
workers as their own flags."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.engine_config import EngineConfig
from services.common import settings
from services.decode.config import load_config as decode_config
from services.prefill.config import load_config as prefill_config
from services.up import UpConfig, assign_cores, load_up_config, prefill_flags, worker_placement


def test_pinning_is_the_default_with_the_first_core_for_the_control_plane() -> None:
    cfg = load_up_config([], {})
    assert cfg.pin and cfg.control_cpus is None
    assert cfg.control_cores([0, 1]) == {0}
    assert cfg.control_cores([4, 5, 6]) == {4}
    assert cfg.control_cores([3]) is None  # one core: nothing to keep apart
    assert load_up_config(["--no-pin"], {}).control_cores([0, 1]) is None
    assert load_up_config(["--control-cpus", "1"], {}).control_cores([0, 1]) == {1}
    assert load_up_config(["--no-pin", "--control-cpus", "0"], {}).control_cores([0, 1]) == {0}
    assert not load_up_config([], {"PDSERVE_UP_PIN": "false"}).pin


def test_assign_cores_puts_decode_workers_first_and_away_from_the_control_plane() -> None:
    # two cores, control plane on 0: the decode worker gets the free core
    assert assign_cores(["prefill-0", "decode-0"], [0, 1], {0}) == {"decode-0": 1, "prefill-0": 0}
    assert assign_cores(["colocated-0"], [0, 1], {0}) == {"colocated-0": 1}
    # more workers than free cores: round-robin over free cores, then control cores
    assert assign_cores(["prefill-0", "prefill-1", "decode-0", "decode-1"], [0, 1, 2, 3], {0}) == {
        "decode-0": 1, "decode-1": 2, "prefill-0": 3, "prefill-1": 0,
    }  # fmt: skip
    # no control plane pinned: decode workers still come first
    assert assign_cores(["prefill-0", "decode-0"], [4, 5], None) == {"decode-0": 4, "prefill-0": 5}


def test_pinned_workers_keep_the_core_for_the_engine_thread_and_share_free_control_cores() -> None:
    # a control core no worker computes on: the process may also run there, the engine
    # thread only on its core; a decoding worker's KV store runs on the control cores
    assert worker_placement("colocated-0", {"colocated-0": 1}, {0}) == (
        {0, 1}, ["--engine-cpus", "1", "--kv-store-cpus", "0"],
    )  # fmt: skip
    plan = {"decode-0": 1, "decode-1": 2, "prefill-0": 3}
    assert worker_placement("decode-0", plan, {0}) == (
        {0, 1}, ["--engine-cpus", "1", "--kv-store-cpus", "0"],
    )  # fmt: skip
    assert worker_placement("prefill-0", plan, {0, 1}) == ({0, 3}, ["--engine-cpus", "3"])
    # the only control core runs a prefill worker: nothing spare, whole process on its
    # core; the decode worker's store still goes to the control core, away from its engine
    two = {"decode-0": 1, "prefill-0": 0}
    assert worker_placement("decode-0", two, {0}) == ({1}, ["--kv-store-cpus", "0"])
    assert worker_placement("prefill-0", two, {0}) == ({0}, [])
    # a decode worker on the control core itself keeps its store with it
    assert worker_placement("decode-0", {"decode-0": 0}, {0}) == ({0}, [])
    # no control cores named: the whole process on its core
    assert worker_placement("decode-0", {"decode-0": 1}, None) == ({1}, [])
    # not pinned at all
    assert worker_placement("decode-0", {}, {0}) == (None, [])
    # the flags it hands out are ones both workers parse, for cores outside their own
    assert decode_config(["--engine-cpus", "0"], {}).tuning.engine_cpus == {0}
    assert decode_config(["--kv-store-cpus", "0"], {}).store.kv_store_cpus == {0}
    assert prefill_config(["--engine-cpus", "0"], {}).tuning.engine_cpus == {0}


def test_engine_settings_reach_the_workers_as_their_own_flags() -> None:
    cfg = load_up_config(["--kv-cache-mib", "96", "--threads", "1", "--no-cpu-kernels"], {})
    assert cfg.engine == EngineConfig(kv_cache_mib=96, threads=1, cpu_kernels=False)
    argv = settings.to_argv(cfg.engine)
    assert prefill_config(argv, {}).engine == cfg.engine
    assert decode_config(argv, {}).engine == cfg.engine


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--prefill", "0"], "need at least one prefill and one decode worker"),
        (["--transport", "shm,rdma"], "transport must name shm, tcp or mooncake"),
        (["--transport", ""], "transport must name shm, tcp or mooncake"),
        (["--control-cpus", "100000"], "argument --control-cpus"),
    ],
)
def test_a_stack_that_cannot_run_is_a_usage_error(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        load_up_config(argv, {})
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_smoke_takes_an_optional_question() -> None:
    assert load_up_config([], {}).smoke is None
    assert load_up_config(["--smoke"], {}).smoke == "What is the capital of France?"
    assert load_up_config(["--smoke", "Why?"], {}).smoke == "Why?"
    assert UpConfig(colocated=True, prefill=0).colocated


def test_pdserve_up_restarts_every_process_redis_and_the_scheduler_too(tmp_path) -> None:
    from services.launcher import Proc, Stack
    from services.up import supervise

    stack = Stack(log_dir=tmp_path)
    for name in ("redis", "scheduler", "prefill-0", "decode-0", "decode-1", "gateway"):
        stack.procs.append(Proc(name, ["true"]))  # listed, never started
    assert supervise(stack, print).restartable == {
        "redis", "scheduler", "prefill-0", "decode-0", "decode-1", "gateway"
    }  # fmt: skip


def test_pdserve_up_redis_keeps_what_it_was_told_across_a_kill_9(tmp_path) -> None:
    """... and only to its ACL user: no password, no access (a password file of 0600);
    memory is capped with an eviction policy."""
    import redis

    from services.launcher import REDIS_USER, Stack, free_port, redis_password_file, redis_proc

    port = free_port()
    stack = Stack(log_dir=tmp_path)
    proc = stack.start(redis_proc(port, tmp_path), ready_line="Ready to accept connections")
    try:
        stack.wait_ready([proc], timeout=10)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=2).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=2, password="guess").ping()
        secret = redis_password_file(tmp_path)
        assert secret.stat().st_mode & 0o077 == 0
        client = redis.Redis(
            port=port, socket_timeout=2, username=REDIS_USER, password=secret.read_text()
        )
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
        assert int(client.config_get("maxmemory")["maxmemory"]) > 0
        client.hset("pdserve:request:r1", mapping={"status": "placed"})
        assert proc.popen is not None
        proc.popen.kill()
        proc.popen.wait(5)
        stack.restart(proc)  # what the supervisor does: same command line, same port
        stack.wait_ready([proc], timeout=10)
        assert client.hget("pdserve:request:r1", "status") == b"placed"
        assert (tmp_path / "redis").is_dir()
        client.close()
    finally:
        stack.stop()


def test_worker_memory_lines_come_from_their_ready_lines() -> None:
    from services.up import _memory_line

    ready = "READY decode 127.0.0.1:5000 weights=quantized weight_mib=98.9 kv_mib=511.9"
    assert _memory_line(ready) == "quantized weights 98.9 MiB, KV 511.9 MiB"
    assert _memory_line("READY decode 127.0.0.1:5000") == ""  # an older worker: no line
    ready += " kv_dtype=float16"
    assert _memory_line(ready) == "quantized weights 98.9 MiB, KV 511.9 MiB float16"


def test_mooncake_flows_from_pdserve_up_to_both_kinds_of_worker() -> None:
    cfg = load_up_config(["--transport", "shm,mooncake"], {})
    flags = prefill_flags(cfg)
    assert flags == ["--transports", "shm,tcp,mooncake"]
    pre = prefill_config([*flags, "--mooncake-protocol", "tcp", "--host", "10.0.0.5"], {})
    assert pre.transport_options("mooncake") == {
        "host": "10.0.0.5",
        "protocol": "tcp",
        "devices": (),
    }
    assert prefill_flags(load_up_config([], {})) == []  # no engine where nothing uses it
    with pytest.raises(SystemExit):
        prefill_config(["--transports", "shm,rdma"], {})


def _children(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.add(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead: it only waits to be reaped
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _listeners(port: int) -> list[str]:
    """Who holds a listening TCP socket on ``port``: "pid cmdline" where /proc tells, else the
    socket's inode. Read from /proc/net/tcp and tcp6 (state 0A is LISTEN)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    owners = []
    for inode in inodes:
        owner = f"socket inode {inode}"
        for fd in Path("/proc").glob("[0-9]*/fd/*"):
            try:
                if os.readlink(fd) == f"socket:[{inode}]":
                    pid = fd.parts[2]
                    owner = f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes()!r}"
                    break
            except OSError:
                continue
        owners.append(owner)
    return owners


def test_kill_9_of_pdserve_up_leaves_no_process_of_its_stack(tmp_path) -> None:
    """Every child asks for SIGKILL when pdserve up dies (PR_SET_PDEATHSIG): within seconds
    none is left, and the ports it served are free for the next pdserve up."""
    import subprocess
    import sys
    import time

    from services.launcher import free_port

    http = free_port()
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--colocated", "--http-port", str(http),
            "--grpc-port", "0", "--log-dir", str(tmp_path), "--kv-cache-mib", "32"]  # fmt: skip
    up = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        assert up.stderr is not None
        for line in up.stderr:
            if "pdserve is up" in line or time.monotonic() > deadline:
                break
        stack = _children(up.pid)
        assert len(stack) >= 5, stack  # redis, the store's master, scheduler, worker, gateway
        up.kill()
        up.wait(5)
        # Then nothing listens on the gateway's port any more: no grandchild kept the
        # listening socket. (Read from the kernel's socket table, not probed: a connect to a
        # closed local port can connect to itself. And waited for: a killed process's main
        # thread is a zombie while its other threads still exit, holding its sockets.)
        deadline = time.monotonic() + 10
        while (any(_alive(p) for p in stack) or _listeners(http)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in stack if _alive(p)]
        assert not _listeners(http), _listeners(http)
    finally:
        if up.poll() is None:
            up.kill()

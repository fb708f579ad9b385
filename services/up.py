"""``pdserve up``: start the local stack and (optionally) send it a real request.

Disaggregated (default): redis-server, the scheduler, ``--prefill`` prefill workers,
``--decode`` decode workers and the gateway, each its own process. ``--colocated``: one
colocated worker (prefill and decode in one engine) behind the same scheduler and gateway:
the baseline. ``--pin`` gives each worker its own CPU core (``pin_plan``: decode workers
first, on cores outside ``--control-cpus`` first, so the latency-critical token loop is the
last to share a core with the control plane); the core is the engine thread's, and the
worker's I/O threads may also use control cores no worker computes on
(``worker_placement``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import urllib.request
from pathlib import Path

from services.common.config import cpu_list, tcp_congestion
from services.launcher import Proc, Stack, default_log_dir, free_port, py, redis_proc


def add_up_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--colocated", action="store_true", help="one colocated worker (baseline)")
    p.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill workers")
    p.add_argument("--decode", type=int, default=1, metavar="N", help="decode workers")
    p.add_argument("--transport", default="shm",
                   help="KV data plane of the decode workers: shm or tcp, or a comma list "
                   "given to them round-robin (e.g. shm,tcp)")  # fmt: skip
    p.add_argument("--kv-tcp-congestion", type=tcp_congestion, default=None, metavar="NAME",
                   help="prefill workers: TCP congestion control of tcp KV connections "
                   "(e.g. reno; default: the system's)")  # fmt: skip
    p.add_argument("--heartbeat-ttl", type=float, default=3.0, metavar="SECONDS",
                   help="the scheduler drops a worker silent this long")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address every service binds")
    p.add_argument("--http-port", type=int, default=8000, help="gateway OpenAI HTTP port")
    p.add_argument("--grpc-port", type=int, default=50051, help="gateway gRPC port")
    p.add_argument("--scheduler-port", type=int, default=0, help="scheduler gRPC (0: free)")
    p.add_argument("--redis-port", type=int, default=0, help="redis-server port (0: free)")
    p.add_argument("--threads-per-worker", type=int, default=1, help="torch threads per worker")
    p.add_argument("--pin", action="store_true",
                   help="pin each worker to its own CPU core (decode workers first, "
                   "away from --control-cpus first); when some control cores run no "
                   "worker, only each worker's engine thread is held to its core, and its "
                   "event loop, gRPC and KV sender threads may also run on those")  # fmt: skip
    p.add_argument("--control-cpus", type=cpu_list, default=None, metavar="CPUS",
                   help="pin redis, the scheduler and the gateway to these cores "
                   "(comma list, e.g. 0; default: not pinned)")  # fmt: skip
    p.add_argument("--kv-cache-mib", type=int, default=512, help="KV pool per worker")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--chunked-prefill", type=int, default=0, metavar="TOKENS",
                   help="colocated worker: chunk prompts (0: off)")  # fmt: skip
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2)")
    p.add_argument("--log-dir", type=Path, default=None, help="per-process logs (default: tmp)")
    p.add_argument("--echo-logs", action="store_true", help="copy every process log to stderr")
    p.add_argument("--smoke", nargs="?", const="What is the capital of France?", default=None,
                   metavar="QUESTION",
                   help="send one streaming chat request through the gateway, print the "
                   "answer and stop")  # fmt: skip


def prefill_flags(args: argparse.Namespace) -> list[str]:
    """The flags of ours every prefill worker is started with (beyond the common ones)."""
    if args.kv_tcp_congestion:
        return ["--kv-tcp-congestion", args.kv_tcp_congestion]
    return []


def pin_plan(workers: list[str], cores: list[int], control: set[int] | None) -> dict[str, int]:
    """One core per worker, round-robin: decode (and colocated) workers are placed before
    prefill workers, and cores outside ``control`` are handed out before control cores.

    >>> pin_plan(["prefill-0", "decode-0"], [0, 1], {0})
    {'decode-0': 1, 'prefill-0': 0}
    """
    order = [w for w in workers if not w.startswith("prefill-")]
    order += [w for w in workers if w.startswith("prefill-")]
    ranked = [c for c in cores if c not in (control or set())]
    ranked += [c for c in cores if c in (control or set())]
    return {w: ranked[i % len(ranked)] for i, w in enumerate(order)}


def worker_placement(
    name: str, plan: dict[str, int], control: set[int] | None
) -> tuple[set[int] | None, list[str]]:
    """``(the worker process's cores, its pinning flags)`` under ``--pin``.

    A worker's engine thread always gets its core from ``plan``. Its other threads (event
    loop, gRPC, KV senders) may also run on the control cores that no worker's engine is
    pinned to: with ``--engine-cpus`` keeping the engine thread on its core, they then run
    beside a step's compute instead of queueing behind it for the one core (measured in
    docs/benchmarks.md, "Serving hop"). A control core that runs another worker's engine is
    no spare room: a prefill computing there would hold the tokens back longer (measured
    too, "Interference"), so without a free control core the whole process stays on its
    core. A worker outside ``plan``: not pinned.

    >>> worker_placement("decode-0", {"decode-0": 1}, {0})
    ({0, 1}, ['--engine-cpus', '1'])
    >>> worker_placement("decode-0", {"decode-0": 1, "prefill-0": 0}, {0})
    ({1}, [])
    """
    if name not in plan:
        return None, []
    core = plan[name]
    spare = set(control or ()) - set(plan.values())
    if not spare:
        return {core}, []
    return {core} | spare, ["--engine-cpus", str(core)]


def _engine_args(args: argparse.Namespace) -> list[str]:
    out = ["--kv-cache-mib", str(args.kv_cache_mib), "--threads", str(args.threads_per_worker),
           "--max-num-seqs", str(args.max_num_seqs)]  # fmt: skip
    if args.model:
        out += ["--model", args.model]
    return out


def launch(args: argparse.Namespace, stack: Stack) -> dict[str, str]:
    """Start everything and wait until it serves; returns the endpoints."""
    workdir = stack.log_dir
    redis_port = args.redis_port or free_port()
    control = args.control_cpus
    redis = redis_proc(redis_port, workdir)
    redis.cpus = control
    stack.start(redis, ready_line="Ready to accept connections")
    sched_port = args.scheduler_port or free_port()
    sched = stack.start(Proc("scheduler", py(
        "services.scheduler", "--grpc-host", args.host, "--grpc-port", str(sched_port),
        "--metrics-port", "0", "--redis-url", f"redis://127.0.0.1:{redis_port}/0",
        "--heartbeat-ttl", str(args.heartbeat_ttl),
    ), control))  # fmt: skip
    stack.wait_ready(stack.procs)
    names = (
        ["colocated-0"]
        if args.colocated
        else [f"prefill-{i}" for i in range(args.prefill)]
        + [f"decode-{i}" for i in range(args.decode)]
    )
    plan = pin_plan(names, sorted(os.sched_getaffinity(0)), control) if args.pin else {}

    placement = {name: worker_placement(name, plan, control) for name in names}

    def cpus(name: str) -> set[int] | None:
        return placement[name][0]

    def pin(name: str) -> list[str]:
        return placement[name][1]

    common = ["--host", args.host, "--port", "0", "--scheduler", sched.address,
              "--heartbeat-interval", "0.5"]  # fmt: skip
    metrics: dict[str, str] = {}

    def metrics_flag(name: str) -> list[str]:
        port = free_port()
        metrics[name] = f"http://{args.host}:{port}/metrics"
        return ["--metrics-port", str(port)]

    workers: list[Proc] = []
    if args.colocated:
        extra = ["--chunked-prefill", str(args.chunked_prefill)] if args.chunked_prefill else []
        workers.append(stack.start(Proc("colocated-0", py(
            "services.decode", "--role", "colocated", *common, *_engine_args(args), *extra,
            *pin("colocated-0"), *metrics_flag("colocated-0"),
        ), cpus("colocated-0"))))  # fmt: skip
    else:
        prefill_extra = prefill_flags(args)
        for i in range(args.prefill):
            workers.append(stack.start(Proc(f"prefill-{i}", py(
                "services.prefill", *common, "--worker-id", f"prefill-{i}", *_engine_args(args),
                *prefill_extra, *pin(f"prefill-{i}"), *metrics_flag(f"prefill-{i}"),
            ), cpus(f"prefill-{i}"))))  # fmt: skip
        transports = [t.strip() for t in args.transport.split(",") if t.strip()]
        for i in range(args.decode):
            workers.append(stack.start(Proc(f"decode-{i}", py(
                "services.decode", *common, "--worker-id", f"decode-{i}",
                "--transport", transports[i % len(transports)], *_engine_args(args),
                *pin(f"decode-{i}"), *metrics_flag(f"decode-{i}"),
            ), cpus(f"decode-{i}"))))  # fmt: skip
    gw = ["--host", args.host, "--http-port", str(args.http_port),
          "--grpc-port", str(args.grpc_port),
          "--backend", "cluster", "--scheduler", sched.address]  # fmt: skip
    if args.model:
        gw += ["--model", args.model]
    stack.wait_ready(workers)
    gateway = stack.start(Proc("gateway", py("services.gateway", *gw), control))
    stack.wait_ready([gateway])
    _wait_placeable(args, gateway.address)
    return {
        "http": f"http://{gateway.address}/v1",
        "grpc": _field(gateway.ready_text, "grpc") or f"{args.host}:{args.grpc_port}",
        "scheduler": sched.address,
        "redis": f"redis://127.0.0.1:{redis_port}/0",
        "logs": str(stack.log_dir),
        **{f"metrics:{k}": v for k, v in metrics.items()},
    }


def _field(ready_line: str, key: str) -> str:
    """``key=value`` from a READY line (the gateway prints ``grpc=host:port``)."""
    for part in ready_line.split():
        if part.startswith(f"{key}="):
            return part.split("=", 1)[1]
    return ""


def _wait_placeable(args: argparse.Namespace, address: str, timeout: float = 30.0) -> None:
    """Workers register asynchronously: wait until the gateway reports healthy."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://{address}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the gateway did not report healthy in time")
        time.sleep(0.2)


def smoke(base_url: str, question: str) -> str:
    """One streaming chat completion over plain HTTP; prints the answer as it streams."""
    with urllib.request.urlopen(f"{base_url}/models", timeout=10) as r:
        model = json.load(r)["data"][0]["id"]
    body = json.dumps({
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 64, "temperature": 0, "stream": True,
    }).encode()  # fmt: skip
    req = urllib.request.Request(f"{base_url}/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    text = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            text.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return "".join(text)


def run_up(args: argparse.Namespace) -> int:
    if not args.colocated and (args.prefill < 1 or args.decode < 1):
        print("pdserve up: need at least one prefill and one decode worker", file=sys.stderr)
        return 2
    bad = {t.strip() for t in args.transport.split(",")} - {"shm", "tcp"}
    if bad:
        print(f"pdserve up: unknown transport(s) {sorted(bad)}; use shm or tcp", file=sys.stderr)
        return 2
    log_dir = args.log_dir or default_log_dir()
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(log_dir=log_dir, echo=args.echo_logs)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        endpoints = launch(args, stack)
        mode = "colocated" if args.colocated else (
            f"disaggregated: {args.prefill} prefill + {args.decode} decode over {args.transport}"
        )  # fmt: skip
        print(f"pdserve is up ({mode})", file=sys.stderr)
        for k, v in endpoints.items():
            print(f"  {k:<19} {v}", file=sys.stderr)
        if args.smoke is not None:
            print(f"> {args.smoke}", file=sys.stderr)
            smoke(endpoints["http"], args.smoke)
            return 0
        print("Ctrl-C stops everything.", file=sys.stderr)
        while not stop.wait(0.5):
            dead = stack.dead()
            if dead:
                print(f"pdserve up: {dead[0].name} exited; stopping", file=sys.stderr)
                return 1
        return 0
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 1
    finally:
        stack.stop()

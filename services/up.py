"""``pdserve up``: start the local stack and (optionally) send it a real request.

Disaggregated (default): redis-server, the KV store's mooncake_master, the scheduler,
``--prefill`` prefill workers, ``--decode`` decode workers and the gateway, each its own
process; every worker lends ``--kv-store-segment-mib`` of its DRAM to the KV store
(``kvstore``; 0: no store, no master). ``--colocated``: one
colocated worker (prefill and decode in one engine) behind the same scheduler and gateway:
the baseline. Every worker gets the same engine settings (``EngineConfig``, passed on by
``settings.to_argv``).

Layout (``--pin``, the default; ``--no-pin`` lets the OS place everything): each worker
gets its own CPU core (``assign_cores``: decode workers first, on cores outside
``--control-cpus`` first, so the latency-critical token loop is the last to share a core
with the control plane); the core is the engine thread's, and the worker's I/O threads may
also use control cores no worker computes on (``worker_placement``). The control plane
(redis, scheduler, gateway) runs on ``--control-cpus``: by default, with ``--pin`` on a
machine of two or more cores, its first core.

While it runs, any process that dies (redis, the store's master, the scheduler, a worker,
the gateway) is restarted with the same command line, so on the same port
(``services.supervisor``: backoff, at most 5 restarts of one process a minute; a worker past
that is left down, the control plane past it stops the stack) and the rest keep serving (a
restarted master is empty: the workers mount their segments again). Every process dies with
``pdserve up`` itself, even under ``kill -9`` (``services.launcher``). Redis keeps
an append-only file in ``<log dir>/redis``, so a restarted Redis has the request records; a
restarted scheduler reloads the worker registry from Redis and workers it no longer knows
register again (docs/operations.md). When it stops, KV segments of workers that could not
remove their own are swept.

Every service's /metrics is printed (free ports, but the gateway's HTTP port); ``--prometheus``
also starts Prometheus scraping them (``services.prometheus``, deploy/README.md).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import threading
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.engine_config import EngineConfig
from kvstore.master import READY_LINE as MASTER_READY
from kvstore.master import master_argv
from services.common import settings
from services.common.settings import cpu_list, setting
from services.common.worker_args import MIN_SEGMENT_MIB
from services.launcher import (
    REDIS_USER,
    Proc,
    Stack,
    default_log_dir,
    free_port,
    py,
    redis_password_file,
    redis_proc,
)
from services.prometheus import READY_LINE, prometheus_exe, prometheus_proc, scrape_config
from services.scheduler.model import Routing
from services.scheduler.policy import LOCAL_PREFILL_MAX_TOKENS
from services.supervisor import RestartPolicy, Supervisor

TRANSPORTS = ("shm", "tcp", "mooncake")
SMOKE_QUESTION = "What is the capital of France?"


@dataclass(frozen=True)
class UpConfig:
    """What ``pdserve up`` starts. ``ValueError`` for a stack that cannot run."""

    colocated: bool = setting(False, "one colocated worker (the baseline)")
    prefill: int = setting(1, "prefill workers", metavar="N")
    decode: int = setting(1, "decode workers", metavar="N")
    transport: tuple[str, ...] = setting(
        ("shm",),
        "KV data plane of the decode workers: shm, tcp or mooncake, or a comma list given to "
        "them round-robin (e.g. shm,tcp)",
    )
    heartbeat_ttl_s: float = setting(
        3.0, "the scheduler drops a worker silent this long", metavar="SECONDS"
    )
    routing: str = setting(
        Routing.CACHE_AWARE.value,
        "the scheduler's placement policy (cache-aware, least-loaded, round-robin)",
        choices=[r.value for r in Routing],
    )
    local_prefill_max_tokens: int = setting(
        LOCAL_PREFILL_MAX_TOKENS,
        "decode workers prefill a request themselves when they would compute at most this "
        "many prompt tokens (0: never)",
        metavar="N",
    )
    host: str = setting("127.0.0.1", "address every service binds")
    http_port: int = setting(8000, "gateway OpenAI HTTP port (0: a free one)")
    grpc_port: int = setting(50051, "gateway gRPC port (0: a free one)")
    scheduler_port: int = setting(0, "scheduler gRPC port (0: a free one)")
    redis_port: int = setting(0, "redis-server port (0: a free one)")
    kv_store_segment_mib: int = setting(
        256,
        "start the KV store (a mooncake_master beside Redis) and lend this many MiB of every "
        "worker's DRAM to its pool (0: no store)",
        metavar="MIB",
    )
    pin: bool = setting(
        True,
        "pin each worker to its own CPU core (decode workers first, away from "
        "--control-cpus first); when some control cores run no worker, only each worker's "
        "engine thread is held to its core, and its event loop, gRPC and KV writer threads "
        "may also run on those",
    )
    control_cpus: frozenset[int] | None = setting(
        None,
        "pin redis, the scheduler and the gateway to these cores (comma list; default: the "
        "first core when --pin and the machine has two or more, else not pinned)",
        parse=cpu_list,
        metavar="CPUS",
    )
    log_dir: str | None = setting(
        None,
        "per-process logs and Redis's append-only file (default: a new temporary directory)",
    )
    echo_logs: bool = setting(False, "copy every process log to stderr")
    prometheus: bool = setting(
        False,
        "also start Prometheus (the prometheus binary on PATH) scraping every service; its "
        "config, written from the ports given out, goes to the log dir",
    )
    prometheus_port: int = setting(9090, "--prometheus: its HTTP port (0: a free one)")
    smoke: str | None = setting(
        None,
        "send one streaming chat request through the gateway, print the answer and stop "
        f"(the flag alone asks {SMOKE_QUESTION!r})",
        const=SMOKE_QUESTION,
        metavar="QUESTION",
    )
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if self.kv_store_segment_mib < 0 or 0 < self.kv_store_segment_mib < MIN_SEGMENT_MIB:
            raise ValueError(f"kv_store_segment_mib must be 0 or at least {MIN_SEGMENT_MIB}")
        if self.local_prefill_max_tokens < 0:
            raise ValueError("local_prefill_max_tokens must be >= 0")
        if not self.colocated and (self.prefill < 1 or self.decode < 1):
            raise ValueError("need at least one prefill and one decode worker")
        bad = sorted(set(self.transport) - set(TRANSPORTS))
        if bad or not self.transport:
            raise ValueError(
                f"transport must name shm, tcp or mooncake, got {list(self.transport)}"
            )

    def control_cores(self, cores: Sequence[int]) -> frozenset[int] | None:
        """The cores of redis, the scheduler and the gateway on a machine with ``cores``."""
        if self.control_cpus is not None:
            return self.control_cpus
        return frozenset({min(cores)}) if self.pin and len(cores) >= 2 else None


load_up_config = settings.loader(UpConfig, "up", "pdserve up", __doc__)


def prefill_flags(cfg: UpConfig) -> list[str]:
    """The flags of ours every prefill worker is started with (beyond the common ones)."""
    flags = []
    if "mooncake" in cfg.transport:  # its engine starts only in workers that need it
        flags += ["--transports", "shm,tcp,mooncake"]
    return flags


def assign_cores(workers: list[str], cores: list[int], control: set[int] | None) -> dict[str, int]:
    """One core per worker, round-robin: decode (and colocated) workers are placed before
    prefill workers, and cores outside ``control`` are handed out before control cores.

    >>> assign_cores(["prefill-0", "decode-0"], [0, 1], {0})
    {'decode-0': 1, 'prefill-0': 0}
    """
    order = [w for w in workers if not w.startswith("prefill-")]
    order += [w for w in workers if w.startswith("prefill-")]
    ranked = [c for c in cores if c not in (control or set())]
    ranked += [c for c in cores if c in (control or set())]
    return {w: ranked[i % len(ranked)] for i, w in enumerate(order)}


def worker_placement(
    name: str, assigned: dict[str, int], control: set[int] | None
) -> tuple[set[int] | None, list[str]]:
    """``(the worker process's cores, its pinning flags)`` under ``--pin``.

    A worker's engine thread always gets its core from ``assigned``. Its other threads (event
    loop, gRPC, KV writers) may also run on the control cores that no worker's engine is
    pinned to: with ``--engine-cpus`` keeping the engine thread on its core, they then run
    beside a step's compute instead of queueing behind it for the one core (measured in
    docs/benchmarks.md, "Serving hop"). A control core that runs another worker's engine is
    no spare room: a prefill computing there would hold the tokens back longer (measured
    too, "Interference"), so without a free control core the whole process stays on its
    core. A decode (or colocated) worker's KV store threads run on the control cores other
    than its own (``--kv-store-cpus``), even where a prefill computes: the store's copies and
    transfers, other workers' reads and writes of its segment included, are work the decode
    core must not do, and a prefill is not hurt by sharing its core with them. A worker
    outside ``assigned``: not pinned.

    >>> worker_placement("decode-0", {"decode-0": 1}, {0})
    ({0, 1}, ['--engine-cpus', '1', '--kv-store-cpus', '0'])
    >>> worker_placement("decode-0", {"decode-0": 1, "prefill-0": 0}, {0})
    ({1}, ['--kv-store-cpus', '0'])
    """
    if name not in assigned:
        return None, []
    core = assigned[name]
    store = sorted(set(control or ()) - {core})
    flags = []
    if store and not name.startswith("prefill-"):
        flags = ["--kv-store-cpus", ",".join(map(str, store))]
    spare = set(control or ()) - set(assigned.values())
    if not spare:
        return {core}, flags
    return {core} | spare, ["--engine-cpus", str(core), *flags]


def launch(cfg: UpConfig, stack: Stack) -> dict[str, str]:
    """Start everything and wait until it serves; returns the endpoints.

    In order, each step waiting for what the next one needs: the control plane (redis, the
    KV store's master, the scheduler), the workers, the gateway once the workers are ready
    and registered, and Prometheus last (it scrapes them all)."""
    if cfg.prometheus:
        prometheus_exe()  # a missing binary fails before anything starts
    # One fresh cluster token per stack, in every process's environment (never on a command
    # line); the stack's own, whatever the caller's environment says.
    stack.env["PDSERVE_CLUSTER_TOKEN"] = secrets.token_urlsafe(32)
    cores = sorted(os.sched_getaffinity(0))
    control = cfg.control_cores(cores)
    plane = _start_control_plane(cfg, stack, control)
    workers = _start_workers(cfg, stack, plane, cores, control)
    gateway = _start_gateway(cfg, stack, plane, control)
    endpoints = _endpoints(cfg, stack, plane, workers, gateway)
    if cfg.prometheus:
        endpoints |= _start_prometheus(cfg, stack, plane, workers, gateway)
    return endpoints


@dataclass(frozen=True)
class _ControlPlane:
    """What ``launch`` started before the workers."""

    redis_port: int
    scheduler: Proc
    scheduler_metrics_port: int
    kv_store_port: int | None  # the KV store's master; None: no store

    @property
    def kv_store(self) -> str | None:
        return None if self.kv_store_port is None else f"127.0.0.1:{self.kv_store_port}"


@dataclass(frozen=True)
class _Worker:
    proc: Proc
    metrics: str  # host:port of its /metrics


def _start_control_plane(
    cfg: UpConfig, stack: Stack, control: frozenset[int] | None
) -> _ControlPlane:
    """Redis, the KV store's master (unless ``--kv-store-segment-mib 0``) and the scheduler,
    on the control cores; ready when this returns."""
    workdir = stack.log_dir
    redis_port = cfg.redis_port or free_port()
    redis = redis_proc(redis_port, workdir)
    redis.cpus = control
    stack.start(redis, ready_line="Ready to accept connections")
    store_port = None
    if cfg.kv_store_segment_mib:
        store_port = free_port()
        argv = master_argv(store_port, metrics_port=free_port(), host="127.0.0.1")
        stack.start(Proc("kv-store", argv, control), ready_line=MASTER_READY)
    sched_port = cfg.scheduler_port or free_port()
    sched_metrics = free_port()
    sched = stack.start(Proc("scheduler", py(
        "services.scheduler", "--grpc-host", cfg.host, "--grpc-port", str(sched_port),
        "--metrics-host", cfg.host, "--metrics-port", str(sched_metrics),
        "--redis-url", f"redis://127.0.0.1:{redis_port}/0", "--redis-username", REDIS_USER,
        "--redis-password-file", str(redis_password_file(workdir)),
        "--heartbeat-ttl-s", str(cfg.heartbeat_ttl_s), "--routing", cfg.routing,
        "--local-prefill-max-tokens", str(cfg.local_prefill_max_tokens),
    ), control))  # fmt: skip
    stack.wait_ready(stack.procs)
    return _ControlPlane(redis_port, sched, sched_metrics, store_port)


def _start_workers(
    cfg: UpConfig,
    stack: Stack,
    plane: _ControlPlane,
    cores: list[int],
    control: frozenset[int] | None,
) -> dict[str, _Worker]:
    """The colocated worker, or the prefill and decode workers, each on its cores
    (``assign_cores``); ready when this returns. Keyed by worker name."""
    names = (
        ["colocated-0"]
        if cfg.colocated
        else [f"prefill-{i}" for i in range(cfg.prefill)]
        + [f"decode-{i}" for i in range(cfg.decode)]
    )
    assigned = assign_cores(names, cores, control) if cfg.pin else {}
    store: list[str] = []
    if plane.kv_store is not None:
        store = ["--kv-store", plane.kv_store,
                 "--kv-store-segment-mib", str(cfg.kv_store_segment_mib)]  # fmt: skip
    common = ["--host", cfg.host, "--port", "0", "--scheduler", plane.scheduler.address,
              "--heartbeat-interval-s", "0.5", *store, *settings.to_argv(cfg.engine)]  # fmt: skip
    workers: dict[str, _Worker] = {}

    def start_worker(name: str, module: str, *flags: str) -> None:
        port = free_port()
        cpus, pin = worker_placement(name, assigned, control)
        argv = py(module, *common, "--worker-id", name, *flags, *pin, "--metrics-port", str(port))
        workers[name] = _Worker(stack.start(Proc(name, argv, cpus)), f"{cfg.host}:{port}")

    if cfg.colocated:
        start_worker("colocated-0", "services.decode", "--role", "colocated")
    else:
        for i in range(cfg.prefill):
            start_worker(f"prefill-{i}", "services.prefill", *prefill_flags(cfg))
        for i in range(cfg.decode):
            transport = cfg.transport[i % len(cfg.transport)]
            start_worker(f"decode-{i}", "services.decode", "--transport", transport)
    stack.wait_ready([w.proc for w in workers.values()])
    return workers


def _start_gateway(
    cfg: UpConfig, stack: Stack, plane: _ControlPlane, control: frozenset[int] | None
) -> Proc:
    """The gateway, on the control cores; returns once it can place a request."""
    # Concrete ports, so a restarted gateway listens where clients already connect.
    argv = py("services.gateway", "--host", cfg.host,
              "--http-port", str(cfg.http_port or free_port()),
              "--grpc-port", str(cfg.grpc_port or free_port()),
              "--backend", "cluster", "--scheduler", plane.scheduler.address,
              *settings.to_argv(cfg.engine))  # fmt: skip
    gateway = stack.start(Proc("gateway", argv, control))
    stack.wait_ready([gateway])
    _wait_placeable(gateway.address)
    return gateway


def _start_prometheus(
    cfg: UpConfig, stack: Stack, plane: _ControlPlane, workers: dict[str, _Worker], gateway: Proc
) -> dict[str, str]:
    """Prometheus scraping every service; returns its endpoints."""
    # Prometheus job -> its targets; a worker's job is its role (prefill-0 -> prefill).
    jobs = {"scheduler": [f"{cfg.host}:{plane.scheduler_metrics_port}"],
            "gateway": [gateway.address]}  # fmt: skip
    for name, worker in workers.items():
        jobs.setdefault(name.split("-")[0], []).append(worker.metrics)
    config = stack.log_dir / "prometheus.yml"
    config.write_text(scrape_config(jobs))
    address = f"{cfg.host}:{cfg.prometheus_port or free_port()}"
    stack.wait_ready(
        [stack.start(prometheus_proc(config, address, stack.log_dir), ready_line=READY_LINE)]
    )
    return {"prometheus": f"http://{address}", "prometheus-config": str(config)}


def _endpoints(
    cfg: UpConfig, stack: Stack, plane: _ControlPlane, workers: dict[str, _Worker], gateway: Proc
) -> dict[str, str]:
    """Where the stack serves, what it logs and how much memory each worker holds."""
    memory = {name: _memory_line(w.proc.ready_text) for name, w in workers.items()}
    return {
        "http": f"http://{gateway.address}/v1",
        "grpc": _field(gateway.ready_text, "grpc") or f"{cfg.host}:{cfg.grpc_port}",
        "scheduler": plane.scheduler.address,
        "scheduler-metrics": f"http://{cfg.host}:{plane.scheduler_metrics_port}/metrics",
        "redis": f"redis://127.0.0.1:{plane.redis_port}/0",
        "redis-password-file": str(redis_password_file(stack.log_dir)),  # user REDIS_USER
        **({"kv-store": plane.kv_store} if plane.kv_store is not None else {}),
        "logs": str(stack.log_dir),
        # bench and tests read every metrics:* key as a worker's
        **{f"metrics:{name}": f"http://{w.metrics}/metrics" for name, w in workers.items()},
        **{f"memory:{k}": v for k, v in memory.items() if v},
        "gateway-metrics": f"http://{gateway.address}/metrics",
    }


def _memory_line(ready_line: str) -> str:
    """``quantized weights 103.7 MiB, KV 512.0 MiB float16`` from a worker's READY line."""
    fields = {k: _field(ready_line, k) for k in ("weights", "weight_mib", "kv_mib")}
    if not all(fields.values()):
        return ""
    line = f"{fields['weights']} weights {fields['weight_mib']} MiB, KV {fields['kv_mib']} MiB"
    kv_dtype = _field(ready_line, "kv_dtype")  # absent from an older worker's line
    return f"{line} {kv_dtype}" if kv_dtype else line


def _field(ready_line: str, key: str) -> str:
    """``key=value`` from a READY line (the gateway prints ``grpc=host:port``)."""
    for part in ready_line.split():
        if part.startswith(f"{key}="):
            return part.split("=", 1)[1]
    return ""


def _wait_placeable(address: str, timeout: float = 30.0) -> None:
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


CONTROL_PLANE = ("redis", "scheduler", "gateway")


def supervise(stack: Stack, say: Callable[[str], None]) -> Supervisor:
    """The supervisor ``pdserve up`` runs: every process of the stack is restarted; one that
    keeps dying is given up on, unless the stack cannot serve without it (the control
    plane), which then stops."""
    names = [p.name for p in stack.procs]
    essential = [n for n in names if n in CONTROL_PLANE]
    return Supervisor(stack, names, RestartPolicy(), say, essential=essential)


def run_up(cfg: UpConfig) -> int:
    log_dir = Path(cfg.log_dir) if cfg.log_dir else default_log_dir()
    log_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(log_dir=log_dir, echo=cfg.echo_logs)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        endpoints = launch(cfg, stack)
        mode = "colocated" if cfg.colocated else (
            f"disaggregated: {cfg.prefill} prefill + {cfg.decode} decode over "
            f"{','.join(cfg.transport)}"
        )  # fmt: skip
        print(f"pdserve is up ({mode})", file=sys.stderr)
        for k, v in endpoints.items():
            print(f"  {k:<19} {v}", file=sys.stderr)
        if cfg.smoke is not None:
            print(f"> {cfg.smoke}", file=sys.stderr)
            smoke(endpoints["http"], cfg.smoke)
            return 0
        print("Ctrl-C stops everything.", file=sys.stderr)
        supervisor = supervise(stack, lambda line: print(f"pdserve up: {line}", file=sys.stderr))
        while not stop.wait(0.5):
            reason = supervisor.tick()
            if reason is not None:
                print(f"pdserve up: {reason}", file=sys.stderr)
                return 1
        return 0
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 1
    finally:
        stack.stop()
        # Segments of workers that could not unlink their own (killed, or past the grace).
        from transfer.shm import sweep_stale_segments  # here: it imports torch

        for path in sweep_stale_segments():
            print(f"pdserve up: removed the stale KV segment {path}", file=sys.stderr)

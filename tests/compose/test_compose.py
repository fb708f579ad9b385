"""compose/ held against the code, without a Docker engine.

``check_compose`` parses every service's command with that service's own ``load_config``
and cross-checks what the services are told about each other: scheduler and Redis
addresses, ports, healthcheck ports, KV transports, replicas, drain times, and the engine
settings (the ``EngineConfig`` defaults but for ``COMPOSE_ENGINE``).
``check_dockerfile`` holds the image to an offline build (local base, wheelhouse only). Both
return a list of problems; the mutation tests show each check can fail. The probe tests run
the real healthcheck commands and the advertise-host wrapper; ``test_live_stack.py`` runs the
whole stack in Docker.
"""

from __future__ import annotations

import contextlib
import copy
import http.server
import itertools
import json
import re
import shlex
import subprocess
import sys
import threading
import tomllib
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.engine_config import EngineConfig
from kvstore.master import master_argv
from services.scheduler.policy import HOST_LOCAL_TRANSPORTS
from tests.service_argv import ALL_INTERFACES, PARSERS, WORKERS, Problem, parse_service

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
DOCKERFILE = COMPOSE_DIR / "Dockerfile"

RESTARTING = ("on-failure", "always", "unless-stopped")  # Docker's policies that restart
# The worker entrypoint: appends the container's own hostname as the advertised address.
ADVERTISE_ENTRYPOINT = [
    "/bin/sh",
    "-c",
    'exec "$@" --advertise-host "$HOSTNAME"',
    "advertise-hostname",
]
CONTAINER_HOSTNAME = "0123456789ab"  # what Docker puts in HOSTNAME: the short container id
BUILD_SCRIPT = COMPOSE_DIR / "build.sh"
WHEELHOUSE = "compose/.wheelhouse"
PROMETHEUS_IMAGE = re.search(r"^PROMETHEUS_BASE=(\S+)", BUILD_SCRIPT.read_text(), re.M).group(1)  # type: ignore[union-attr]
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
REDIS_IMAGE = re.search(r"^REDIS_BASE=(\S+)$", BUILD_SCRIPT.read_text(), re.M).group(1)  # type: ignore[union-attr]
NETWORK_TOOLS = re.compile(r"\b(apt-get|apt|curl|wget|git|conda|uv|poetry)\b|--index-url|https?://")

# What compose sets on purpose beyond the shared engine defaults: one torch thread per
# worker container, whatever the host's cores (compose/README.md).
COMPOSE_ENGINE = {
    "services.prefill": EngineConfig(threads=1),
    "services.decode": EngineConfig(threads=1),
}


# --- reading compose values ----------------------------------------------------------------


def unescape(text: str) -> str:
    """Compose's interpolation of one string: ``$$`` is a literal ``$``.

    Any other ``$`` would substitute the host's environment at ``docker compose up`` time,
    which would make the commands checked here differ from the ones that run: refused.
    """
    if re.search(r"\$(?!\$)", text.replace("$$", "")):
        raise Problem(f"host-environment interpolation in {text!r}")
    return text.replace("$$", "$")


def as_argv(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        raise Problem(f"{where} must be a list of strings (exec form), got {value!r}")
    return [unescape(a) for a in value]


def effective_argv(name: str, svc: dict[str, Any]) -> list[str]:
    """The argv the container's process gets: the command, through the entrypoint if any."""
    argv = as_argv(svc.get("command"), f"{name}.command")
    if "entrypoint" not in svc:
        return argv
    entry = as_argv(svc["entrypoint"], f"{name}.entrypoint")
    if entry != ADVERTISE_ENTRYPOINT:
        raise Problem(f"{name}: unknown entrypoint {entry!r}")
    # test_advertise_entrypoint_appends_the_hostname runs the real wrapper to show this.
    return [*argv, "--advertise-host", CONTAINER_HOSTNAME]


def env_names(svc: dict[str, Any]) -> list[str]:
    env = svc.get("environment") or {}
    if isinstance(env, dict):
        return list(env)
    return [str(item).split("=", 1)[0] for item in env]


def healthcheck_argv(name: str, svc: dict[str, Any]) -> list[str]:
    test = (svc.get("healthcheck") or {}).get("test")
    if not isinstance(test, list) or not test or test[0] != "CMD":
        raise Problem(f"{name}: healthcheck.test must be an exec-form [CMD, ...] list")
    return [unescape(a) for a in test[1:]]


def healthcheck_port(name: str, svc: dict[str, Any]) -> int:
    ports = {
        int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", " ".join(healthcheck_argv(name, svc)))
    }
    if len(ports) != 1:
        raise Problem(f"{name}: healthcheck must probe exactly one 127.0.0.1 port, got {ports}")
    return ports.pop()


def published_ports(name: str, svc: dict[str, Any]) -> dict[int, int]:
    """Container port → host port."""
    out: dict[int, int] = {}
    for p in svc.get("ports") or []:
        if isinstance(p, dict):
            host, container = p.get("published"), p.get("target")
        else:
            # `${VAR:-default}` is what compose publishes when VAR is unset.
            spec = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(p))
            parts = spec.split("/")[0].split(":")
            if len(parts) < 2:
                raise Problem(f"{name}: port {p!r} leaves the host port to chance")
            host, container = parts[-2], parts[-1]
        out[int(container)] = int(host)
    return out


def seconds(duration: Any) -> float:
    """A compose duration (``40s``, ``1m30s``) in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    text = str(duration)
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", text)
    if not parts or "".join(a + b for a, b in parts) != text:
        raise Problem(f"not a duration: {duration!r}")
    return sum(float(n) * units[u] for n, u in parts)


def depends_on_healthy(svc: dict[str, Any], other: str) -> bool:
    deps = svc.get("depends_on") or {}
    return isinstance(deps, dict) and (deps.get(other) or {}).get("condition") == "service_healthy"


# --- the checks ----------------------------------------------------------------------------


def check_compose(compose: dict[str, Any]) -> list[str]:
    """Every way ``compose`` disagrees with the services' code; empty when it agrees."""
    problems: list[str] = []
    services: dict[str, dict[str, Any]] = compose.get("services") or {}
    parsed: dict[str, tuple[str, Any]] = {}  # module -> (service name, parsed flags)
    pdserve_images = set()

    redis = [n for n, s in services.items() if s.get("image") == REDIS_IMAGE]
    if len(redis) != 1:
        problems.append(f"need exactly one redis service, got {redis}")

    stores = [n for n, s in services.items() if _runs_kv_store_master(s)]
    if len(stores) != 1:
        problems.append(f"need exactly one KV store master service, got {stores}")
    for name, svc in services.items():
        if name in redis:
            continue
        if svc.get("image") == PROMETHEUS_IMAGE:
            problems += _check_prometheus(name, svc)
            continue
        if name in stores:
            problems += _check_kv_store(name, svc)
            continue
        try:
            module, cfg = parse_service(name, effective_argv(name, svc))
        except Problem as e:
            problems.append(str(e))
            continue
        if module in parsed:
            problems.append(f"{module} runs in both {parsed[module][0]} and {name}")
        parsed[module] = (name, cfg)
        build = svc.get("build") or {}
        context = (COMPOSE_DIR / str(build.get("context", "?"))).resolve()
        if context != ROOT or context / str(build.get("dockerfile", "Dockerfile")) != DOCKERFILE:
            problems.append(f"{name}: must build compose/Dockerfile with the repository root")
        pdserve_images.add(svc.get("image"))
        if pdserve := [v for v in env_names(svc) if v.startswith("PDSERVE_")]:
            problems.append(f"{name}: PDSERVE_ environment {pdserve} hides flags from the command")
        if "container_name" in svc or "hostname" in svc:
            problems.append(f"{name}: a fixed container_name/hostname breaks replicas")
    for name, svc in services.items():
        if str(svc.get("restart", "no")).split(":")[0] not in RESTARTING:
            problems.append(f"{name}: restart policy {svc.get('restart', 'no')!r} leaves it dead")
    if len(pdserve_images) != 1:
        problems.append(f"the pdserve services must share one image, got {pdserve_images}")
    if missing := sorted(set(PARSERS) - set(parsed)):
        problems.append(f"no service runs {missing}")
        return problems

    redis_name = redis[0] if len(redis) == 1 else "redis"
    sched_name, sched = parsed["services.scheduler"]
    problems += _check_scheduler(services, sched_name, sched, redis_name)
    sched_addr = f"{sched_name}:{sched.grpc_port}"
    store_addr = _kv_store_address(stores[0], services[stores[0]]) if len(stores) == 1 else None
    for module in WORKERS:
        name, args = parsed[module]
        problems += _check_worker(name, services[name], args, sched_name, sched_addr, sched)
        if args.store.kv_store != store_addr or not args.store.enabled:
            problems.append(
                f"{name}: --kv-store {args.store.kv_store} (segment "
                f"{args.store.kv_store_segment_mib} MiB) is not the store at {store_addr}"
            )
    problems += _check_transports(parsed["services.prefill"], parsed["services.decode"])
    problems += _check_gateway(services, parsed, sched_addr)
    models = {m: cfg.engine.model for m, (_, cfg) in parsed.items() if m != "services.scheduler"}
    if len(set(models.values())) != 1:
        problems.append(f"services load different models: {models}")
    for module, (name, cfg) in parsed.items():
        want = COMPOSE_ENGINE.get(module, EngineConfig())
        if module != "services.scheduler" and cfg.engine != want:
            problems.append(f"{name}: engine settings {cfg.engine} are not {want}")
    return problems


def _runs_kv_store_master(svc: dict[str, Any]) -> bool:
    command = svc.get("command")
    return isinstance(command, list) and bool(command) and command[0] == "mooncake_master"


def _kv_store_address(name: str, svc: dict[str, Any]) -> str:
    flags = dict(a.split("=", 1) for a in svc["command"][1:] if "=" in a)
    return f"{name}:{flags.get('--rpc_port')}"


def _check_kv_store(name: str, svc: dict[str, Any]) -> list[str]:
    """The KV store's master runs the command line ``kvstore.master`` gives it, reachable
    from the other containers, and is restarted when it dies."""
    argv = as_argv(svc.get("command"), f"{name}.command")
    flags = dict(a.split("=", 1) for a in argv[1:] if "=" in a)
    try:
        port, metrics = int(flags["--rpc_port"]), int(flags["--metrics_port"])
    except (KeyError, ValueError):
        return [f"{name}: mooncake_master needs --rpc_port=N and --metrics_port=N"]
    want = master_argv(port, metrics_port=metrics)[1:]
    if argv[1:] != want:
        return [f"{name}: mooncake_master {argv[1:]} is not kvstore.master's {want}"]
    try:
        if healthcheck_port(name, svc) != port:
            return [f"{name}: the healthcheck does not probe port {port}"]
    except Problem as e:
        return [str(e)]
    return []


def _check_prometheus(name: str, svc: dict[str, Any]) -> list[str]:
    """The monitoring profile's Prometheus reads deploy/prometheus/prometheus.yml."""
    argv = as_argv(svc.get("command"), f"{name}.command")
    config = [a.split("=", 1)[1] for a in argv if a.startswith("--config.file=")]
    mounts = {}
    for v in svc.get("volumes") or []:
        src, _, dest = str(v).partition(":")
        mounts[dest.split(":")[0]] = (COMPOSE_DIR / src).resolve()
    if len(config) != 1 or mounts.get(config[0]) != PROMETHEUS_CONFIG:
        return [f"{name}: --config.file {config} is not deploy/prometheus/prometheus.yml"]
    if not svc.get("profiles"):
        return [f"{name}: runs without a profile; monitoring is opt-in"]
    return []


def _check_scheduler(
    services: dict[str, dict[str, Any]], name: str, sched: Any, redis_name: str
) -> list[str]:
    problems = []
    redis_argv = services.get(redis_name, {}).get("command") or []
    redis_port = 6379  # the redis image's default, unless its command says otherwise
    if "--port" in redis_argv:
        redis_port = int(redis_argv[redis_argv.index("--port") + 1])
    # Debian's redis-server without a config file is in protected mode: no password, so it
    # refuses every client that is not on its loopback.
    flags = list(itertools.pairwise(redis_argv))
    if ("--protected-mode", "no") not in flags:
        problems.append(f"{redis_name}: protected mode refuses the other containers")
    if ("--dir", "/data") not in flags or not any(
        str(v).endswith(":/data") for v in services.get(redis_name, {}).get("volumes") or []
    ):
        problems.append(f"{redis_name}: the append-only file must live in a volume at /data")
    # Redis is a trust root: only an ACL user with a password logs in, and its memory is
    # capped with an eviction policy (an OOM kill that AOF replay repeats otherwise).
    redis_svc = services.get(redis_name, {})
    if "--aclfile" not in redis_argv:
        problems.append(f"{redis_name}: no --aclfile: anyone on the network logs in")
    if "--maxmemory" not in redis_argv or "--maxmemory-policy" not in redis_argv:
        problems.append(f"{redis_name}: memory is not capped (--maxmemory, -policy)")
    if not sched.redis_username or not sched.redis_password_file:
        problems.append(f"{name}: logs in to Redis without --redis-username/-password-file")
    secret = str(sched.redis_password_file or "").removeprefix("/run/secrets/")
    if secret not in (redis_svc.get("secrets") or []) or secret not in (
        services[name].get("secrets") or []
    ):
        problems.append(f"{name} and {redis_name} must share the Redis password secret")
    if sched.grpc_host not in ALL_INTERFACES:
        problems.append(f"{name}: binds {sched.grpc_host}; other containers cannot reach it")
    url = urlparse(sched.redis_url)
    if (url.scheme, url.hostname, url.port or 6379) != ("redis", redis_name, redis_port):
        problems.append(f"{name}: --redis-url {sched.redis_url} is not {redis_name}:{redis_port}")
    if not depends_on_healthy(services[name], redis_name):
        problems.append(f"{name} must wait for {redis_name} to be healthy")
    return problems + _port_checks(name, services[name], sched.grpc_port, drain=None)


def _check_worker(
    name: str, svc: dict[str, Any], args: Any, sched_name: str, sched_addr: str, sched: Any
) -> list[str]:
    problems = []
    w = args.worker
    if w.host not in ALL_INTERFACES:
        problems.append(f"{name}: binds {w.host}; other containers cannot reach it")
    if w.advertise_host in (None, *ALL_INTERFACES):
        problems.append(f"{name}: no --advertise-host; it would register 127.0.0.1")
    if w.worker_id is not None:
        problems.append(f"{name}: --worker-id {w.worker_id} is shared by every replica")
    if w.scheduler != sched_addr:
        problems.append(f"{name}: --scheduler {w.scheduler} is not {sched_addr}")
    if not w.heartbeat_interval_s < sched.heartbeat_ttl_s:
        problems.append(
            f"{name}: heartbeats every {w.heartbeat_interval_s}s, lease is {sched.heartbeat_ttl_s}s"
        )
    replicas = (svc.get("deploy") or {}).get("replicas")
    if not isinstance(replicas, int) or replicas < 1:
        problems.append(f"{name}: needs deploy.replicas (an int >= 1), got {replicas!r}")
    if svc.get("ports"):
        problems.append(f"{name}: published ports collide when it is scaled")
    if not depends_on_healthy(svc, sched_name):
        problems.append(f"{name} must wait for {sched_name} to be healthy")
    return problems + _port_checks(name, svc, w.port, drain=w.drain_timeout_s)


def _check_transports(prefill: tuple[str, Any], decode: tuple[str, Any]) -> list[str]:
    """The KV path between containers: no host-local transport, and one both sides share."""
    (pname, p), (dname, d) = prefill, decode
    problems = []
    can_write = list(p.transports)
    if host_local := [t for t in can_write if t in HOST_LOCAL_TRANSPORTS]:
        problems.append(f"{pname}: --transports {host_local} do not work across containers")
    if d.role != "decode":
        problems.append(f"{dname}: --role {d.role}; the stack needs decode workers")
    if d.transport in HOST_LOCAL_TRANSPORTS:
        problems.append(f"{dname}: --transport {d.transport} does not work across containers")
    if d.transport not in can_write:
        problems.append(f"{pname} cannot write KV over {dname}'s {d.transport}")
    return problems


def _check_gateway(
    services: dict[str, dict[str, Any]], parsed: dict[str, tuple[str, Any]], sched_addr: str
) -> list[str]:
    problems = []
    name, gw = parsed["services.gateway"]
    svc = services[name]
    if gw.backend != "cluster":
        problems.append(f"{name}: --backend {gw.backend}; the stack needs the cluster backend")
    if gw.scheduler != sched_addr:
        problems.append(f"{name}: --scheduler {gw.scheduler} is not {sched_addr}")
    if gw.host not in ALL_INTERFACES:
        problems.append(f"{name}: binds {gw.host}; published ports would not reach it")
    try:
        published = published_ports(name, svc)
        want = {gw.http_port: gw.http_port, gw.grpc_port: gw.grpc_port}
        if published != want:
            problems.append(f"{name}: publishes {published} (container: host), flags say {want}")
    except Problem as e:
        problems.append(str(e))
    for module in ("services.scheduler", *WORKERS):
        dep = parsed[module][0]
        if not depends_on_healthy(svc, dep):
            problems.append(f"{name} must wait for {dep} to be healthy")
    return problems + _port_checks(name, svc, gw.http_port, drain=gw.drain_timeout_s)


def _port_checks(name: str, svc: dict[str, Any], port: int, drain: float | None) -> list[str]:
    problems = []
    try:
        probed = healthcheck_port(name, svc)
        if probed != port:
            problems.append(
                f"{name}: healthcheck probes port {probed}, the service listens on {port}"
            )
    except Problem as e:
        problems.append(str(e))
    if drain is not None:
        try:
            grace = seconds(svc.get("stop_grace_period", "10s"))
            if not grace > drain:
                problems.append(f"{name}: stop_grace_period {grace}s cuts its {drain}s drain short")
        except Problem as e:
            problems.append(f"{name}: stop_grace_period: {e}")
    return problems


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        op, _, rest = line.partition(" ")
        out.append((op.upper(), rest.strip()))
    return out


def check_dockerfile(text: str) -> list[str]:
    """Every way the Dockerfile departs from an offline build of pdserve; empty if none.

    Offline: every stage starts from the locally made base (``compose/build.sh``), nothing
    runs apt or fetches, and pip installs only from the wheelhouse (``PIP_NO_INDEX``). The
    packages ``pip install .`` needs are copied to their repository paths before it runs,
    and the CPU kernels are compiled into the image.
    """
    problems: list[str] = []
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    steps = dockerfile_instructions(text)

    base_tag = re.search(r"^PYTHON_BASE=(\S+)$", BUILD_SCRIPT.read_text(), re.M)
    args = dict(a.partition("=")[::2] for op, a in steps if op == "ARG")
    if not base_tag or args.get("BASE_IMAGE") != base_tag.group(1):
        problems.append(f"ARG BASE_IMAGE must default to build.sh's PYTHON_BASE, got {args}")
    bases = [a.split()[0] for op, a in steps if op == "FROM"]
    if not bases or any(b != "${BASE_IMAGE}" for b in bases):
        problems.append(f"every stage must start FROM ${{BASE_IMAGE}} (made locally): {bases}")
    if not any(op == "ENV" and "PIP_NO_INDEX=1" in a for op, a in steps):
        problems.append("pip may reach an index: ENV PIP_NO_INDEX=1 is missing")
    runs = [a for op, a in steps if op == "RUN"]
    for cmd in runs:
        if NETWORK_TOOLS.search(cmd):
            problems.append(f"a build step that needs the network: RUN {cmd}")
    install = [i for i, (op, a) in enumerate(steps) if op == "RUN" and "pip install" in a
               and re.search(r"install[^&]*\s\.(\s|$)", a)]  # fmt: skip
    if len(install) != 1:
        problems.append(f"pdserve must be installed once with `pip install ... .`: {runs}")
    if not any("python -m kernels.build" in cmd for cmd in runs):
        problems.append("the CPU kernels are not compiled into the image (python -m kernels.build)")
    final = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM") :]
    if not any(op == "COPY" and "--from=" in a and "/opt/venv" in a for op, a in final):
        problems.append("the final stage does not take the environment (/opt/venv) from build")

    # `pip install .` runs in WORKDIR: everything it needs must land at its own path there.
    landed: set[str] = set()
    for op, args_ in steps[: install[0]] if install else steps:
        if op not in ("COPY", "ADD"):
            continue
        words = [w for w in shlex.split(args_) if not w.startswith("--")]
        *sources, dest = words
        for src in sources:
            src_path = src.rstrip("/") or "."
            if src_path == WHEELHOUSE:
                continue
            if (ROOT / src_path).is_dir():
                landing = dest.rstrip("/") or "."
            elif dest.endswith("/") or dest in (".", "./") or len(sources) > 1:
                landing = f"{dest.rstrip('/')}/{Path(src_path).name}".removeprefix("./")
            else:
                landing = dest
            landing = landing.removeprefix("./") or "."
            if landing == src_path:
                landed.add(src_path)
            else:
                problems.append(f"COPY {src} lands at {landing}, not at its repository path")
    needed = ["pyproject.toml", pyproject["project"]["readme"]]
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        top = pattern.rstrip("*")
        if (ROOT / top / "__init__.py").is_file():
            needed.append(top)
    for path in needed:
        if not any(c == "." or path == c or path.startswith(c + "/") for c in landed):
            problems.append(f"{path} is not copied into the image before `pip install .`")
    return problems


# --- the real files ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def test_compose_agrees_with_the_code(compose: dict[str, Any]) -> None:
    assert check_compose(compose) == []


def test_compose_parses_into_the_expected_stack(compose: dict[str, Any]) -> None:
    """Spot values, so a checker that accepts anything cannot pass the test above alone."""
    svc = compose["services"]
    _, sched = parse_service("scheduler", effective_argv("scheduler", svc["scheduler"]))
    assert (sched.grpc_port, sched.redis_url) == (50050, "redis://redis:6379/0")
    _, decode = parse_service("decode", effective_argv("decode", svc["decode"]))
    assert (decode.transport, decode.worker.advertise_host) == ("tcp", CONTAINER_HOSTNAME)
    assert decode.worker.scheduler == "scheduler:50050"
    assert (decode.engine.threads, decode.engine.kv_cache_mib) == (1, 512)
    _, gw = parse_service("gateway", effective_argv("gateway", svc["gateway"]))
    assert (gw.http_port, gw.grpc_port, gw.backend) == (8000, 50051, "cluster")
    assert svc["prefill"]["deploy"]["replicas"] == 2 and svc["decode"]["deploy"]["replicas"] == 2


def test_dockerfile_builds_offline() -> None:
    assert check_dockerfile(DOCKERFILE.read_text()) == []


def test_readme_scale_command_names_real_services(compose: dict[str, Any]) -> None:
    readme = (COMPOSE_DIR / "README.md").read_text()
    scaled = re.findall(r"--scale (\w+)=\d+", readme)
    assert scaled and set(scaled) <= {
        n for n, s in compose["services"].items() if "replicas" in (s.get("deploy") or {})
    }


# --- each check can fail -------------------------------------------------------------------


def _set_flag(svc: dict[str, Any], flag: str, value: str | None) -> None:
    """Replace (or, with ``None``, drop) ``--flag=value`` in the command; append if absent."""
    cmd = [a for a in svc["command"] if not a.startswith(flag + "=")]
    svc["command"] = cmd if value is None else [*cmd, f"{flag}={value}"]


def _m(service: str, flag: str, value: str | None) -> Callable[[dict[str, Any]], None]:
    return lambda c: _set_flag(c["services"][service], flag, value)


def _put(service: str, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(c: dict[str, Any]) -> None:
        if value is None:
            c["services"][service].pop(key, None)
        else:
            c["services"][service][key] = value

    return mutate


def _health_port(service: str, port: int) -> Callable[[dict[str, Any]], None]:
    def mutate(c: dict[str, Any]) -> None:
        test = c["services"][service]["healthcheck"]["test"]
        c["services"][service]["healthcheck"]["test"] = [
            re.sub(r"127\.0\.0\.1:\d+", f"127.0.0.1:{port}", a) for a in test
        ]

    return mutate


MUTATIONS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "gateway dials the wrong scheduler port": (
        _m("gateway", "--scheduler", "scheduler:50051"), "gateway: --scheduler scheduler:50051"),
    "a worker dials the wrong scheduler host": (
        _m("prefill", "--scheduler", "sched:50050"), "prefill: --scheduler sched:50050"),
    "scheduler moves, nobody follows": (
        _m("scheduler", "--grpc-port", "50052"), "decode: --scheduler scheduler:50050 is not"),
    "redis on the wrong host": (
        _m("scheduler", "--redis-url", "redis://localhost:6379/0"), "--redis-url"),
    "redis on the wrong port": (
        _m("scheduler", "--redis-url", "redis://redis:6380/0"), "is not redis:6379"),
    "scheduler binds loopback": (_m("scheduler", "--grpc-host", "127.0.0.1"), "binds 127.0.0.1"),
    "redis listens elsewhere": (
        _put("redis", "command", ["redis-server", "--port", "6380"]), "is not redis:6380"),
    "redis protected": (
        _put("redis", "command", ["redis-server", "--dir", "/data"]), "protected mode"),
    "redis without volume": (_put("redis", "volumes", []), "volume at /data"),
    "redis without a password": (
        lambda c: c["services"]["redis"]["command"].remove("--aclfile"), "no --aclfile"),
    "redis memory uncapped": (
        lambda c: c["services"]["redis"]["command"].remove("--maxmemory"), "not capped"),
    "scheduler without the Redis password": (
        _m("scheduler", "--redis-password-file", None), "without --redis-username"),
    "redis without the secret": (_put("redis", "secrets", []), "share the Redis password"),
    "prometheus elsewhere": (
        _put("prometheus", "volumes", ["../deploy/x.yml:/etc/pdserve/prometheus.yml:ro"]),
        "--config.file"),
    "prometheus always on": (_put("prometheus", "profiles", None), "opt-in"),
    "scheduler before redis": (_put("scheduler", "depends_on", None), "wait for redis"),
    "a worker without the KV store": (
        _m("decode", "--kv-store", None), "decode: --kv-store None (segment 256 MiB) is not"),
    "a worker lends no DRAM to the store": (
        _m("prefill", "--kv-store-segment-mib", "0"), "prefill: --kv-store kv-store:50090"),
    "the store moves, nobody follows": (
        lambda c: c["services"]["kv-store"]["command"].__setitem__(1, "--rpc_port=50091"),
        "is not the store at kv-store:50091"),
    "the store's master on other flags": (
        lambda c: c["services"]["kv-store"]["command"].append("--client_ttl=99"),
        "is not kvstore.master's"),
    "two store masters": (
        lambda c: c["services"].update(k2=copy.deepcopy(c["services"]["kv-store"])),
        "exactly one KV store master"),
    "two schedulers": (
        lambda c: c["services"].update(s2=copy.deepcopy(c["services"]["scheduler"])),
        "runs in both"),
    "gateway binds loopback": (_m("gateway", "--host", "127.0.0.1"), "gateway: binds"),
    "gateway before decode": (
        lambda c: c["services"]["gateway"]["depends_on"].pop("decode"), "wait for decode"),
    "bad grace period": (_put("prefill", "stop_grace_period", "forty"), "not a duration"),
    "decode over shm": (_m("decode", "--transport", "shm"), "does not work across containers"),
    "prefill offers shm": (_m("prefill", "--transports", "shm,tcp"), "across containers"),
    "prefill cannot write tcp": (_m("prefill", "--transports", None), "across containers"),
    "colocated role": (_m("decode", "--role", "colocated"), "--role colocated"),
    "unknown flag": (_m("prefill", "--bogus", "1"), "prefill: services.prefill rejects"),
    "bad flag value": (_m("decode", "--port", "many"), "decode: services.decode rejects"),
    "fixed worker id": (_m("decode", "--worker-id", "decode-0"), "shared by every replica"),
    "worker binds loopback": (_m("decode", "--host", "127.0.0.1"), "decode: binds 127.0.0.1"),
    "no advertise wrapper": (_put("prefill", "entrypoint", None), "no --advertise-host"),
    "other entrypoint": (_put("decode", "entrypoint", ["python"]), "unknown entrypoint"),
    "slow heartbeats": (_m("decode", "--heartbeat-interval-s", "5"), "lease is 3.0s"),
    "an engine default restated otherwise": (
        _m("prefill", "--kv-cache-mib", "1024"), "prefill: engine settings"),
    "a worker without its one thread": (_m("decode", "--threads", None), "decode: engine"),
    "gateway local backend": (_m("gateway", "--backend", "local"), "--backend local"),
    "gateway port not published": (
        _m("gateway", "--http-port", "8080"), "gateway: publishes"),
    "gateway published port remapped": (
        _put("gateway", "ports", ["8001:8000", "50051:50051"]), "gateway: publishes"),
    "gateway random host port": (_put("gateway", "ports", ["8000", "50051"]), "to chance"),
    "worker publishes ports": (_put("decode", "ports", ["50071:50071"]), "collide"),
    "no replicas": (_put("decode", "deploy", None), "decode: needs deploy.replicas"),
    "zero replicas": (_put("prefill", "deploy", {"replicas": 0}), "prefill: needs deploy"),
    "healthcheck port": (_health_port("decode", 50061), "healthcheck probes port 50061"),
    "gateway healthcheck port": (_health_port("gateway", 50051), "probes port 50051"),
    "grace shorter than drain": (_put("decode", "stop_grace_period", "10s"), "drain short"),
    "env overrides a flag": (
        _put("decode", "environment", {"PDSERVE_DECODE_TRANSPORT": "shm"}), "PDSERVE_"),
    "host interpolation": (_m("scheduler", "--redis-url", "${REDIS_URL}"), "interpolation"),
    "shell-form command": (_put("gateway", "command", "python -m services.gateway"), "exec"),
    "fixed hostname": (_put("decode", "hostname", "decode"), "breaks replicas"),
    "no start order": (_put("decode", "depends_on", None), "decode must wait for scheduler"),
    "different models": (_m("decode", "--model", "/models/other.gguf"), "different models"),
    "second image": (_put("gateway", "image", "pdserve:other"), "share one image"),
    "other dockerfile": (
        _put("gateway", "build", {"context": "..", "dockerfile": "Dockerfile"}), "gateway: must"),
    "missing service": (lambda c: c["services"].pop("prefill"), "no service runs"),
    "two redis": (lambda c: c["services"].update(cache={"image": REDIS_IMAGE}), "exactly one"),
    "a worker left dead": (_put("decode", "restart", None), "decode: restart policy 'no'"),
    "redis left dead": (_put("redis", "restart", "no"), "redis: restart policy 'no'"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_check_compose_catches(compose: dict[str, Any], name: str) -> None:
    mutate, expected = MUTATIONS[name]
    broken = copy.deepcopy(compose)
    mutate(broken)
    problems = check_compose(broken)
    assert any(expected in p for p in problems), problems


DOCKERFILE_MUTATIONS: dict[str, tuple[Callable[[str], str], str]] = {
    "a registry image": (
        lambda t: t.replace("FROM ${BASE_IMAGE} AS build", "FROM python:3.11-slim AS build"),
        "made locally"),
    "another base": (
        lambda t: t.replace("ARG BASE_IMAGE=pdserve/python:bookworm", "ARG BASE_IMAGE=debian"),
        "PYTHON_BASE"),
    "an index": (lambda t: t.replace("PIP_NO_INDEX=1", "PIP_NO_INDEX=0"), "PIP_NO_INDEX"),
    "extra apt step": (
        lambda t: t + "\nRUN apt-get update && \\\n    apt-get install -y g++\n", "network"),
    "a download": (lambda t: t + "\nRUN pip install https://example.com/x.whl\n", "network"),
    "no kernels": (lambda t: t.replace(" && cd / && python -m kernels.build", ""), "kernels"),
    "wheels left behind": (lambda t: t.replace("COPY --from=build /opt/venv", "COPY /opt/venv"),
                           "/opt/venv"),
    "package not copied": (lambda t: t.replace("COPY kernels/ kernels/\n", ""), "kernels is not"),
    "readme not copied": (lambda t: t.replace("README.md ./", "./"), "README.md is not"),
    "copied to the wrong place": (
        lambda t: t.replace("COPY engine/ engine/", "COPY engine/ ./"), "lands at ."),
    "copied after install": (
        lambda t: t.replace("COPY services/ services/\n", "") + "\nCOPY services/ services/\n",
        "services is not copied"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(DOCKERFILE_MUTATIONS))
def test_check_dockerfile_catches(name: str) -> None:
    mutate, expected = DOCKERFILE_MUTATIONS[name]
    text = DOCKERFILE.read_text()
    broken = mutate(text)
    assert broken != text, "the mutation no longer applies to compose/Dockerfile"
    problems = check_dockerfile(broken)
    assert any(expected in p for p in problems), problems


# --- the commands the containers run, run for real -----------------------------------------


def test_advertise_entrypoint_appends_the_hostname(compose: dict[str, Any]) -> None:
    """The wrapper appends ``--advertise-host $HOSTNAME`` and execs (the service is PID 1)."""
    for name in ("prefill", "decode"):
        entry = as_argv(compose["services"][name]["entrypoint"], name)
        show = "import json, os, sys; print(json.dumps([os.getpid(), sys.argv[1:]]))"
        proc = subprocess.Popen(
            [*entry, sys.executable, "-c", show, "--port=1"],
            stdout=subprocess.PIPE,
            text=True,
            env={"HOSTNAME": CONTAINER_HOSTNAME, "PATH": "/usr/bin:/bin"},
        )
        out, _ = proc.communicate(timeout=30)
        pid, argv = json.loads(out)
        assert argv == ["--port=1", "--advertise-host", CONTAINER_HOSTNAME]
        assert pid == proc.pid, "the wrapper must exec the service, not run it as a child"


@contextlib.contextmanager
def _grpc_health_server() -> Iterator[tuple[int, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port, servicer
    finally:
        server.stop(None)


def _run_probe(argv: list[str], port: int) -> int:
    argv = [re.sub(r"127\.0\.0\.1:\d+", f"127.0.0.1:{port}", a) for a in argv]
    assert argv[0] == "python", argv
    return subprocess.run([sys.executable, *argv[1:]], capture_output=True, timeout=60).returncode


@pytest.mark.parametrize("name", ["scheduler", "prefill", "decode"])
def test_grpc_healthcheck_follows_serving_status(compose: dict[str, Any], name: str) -> None:
    probe = healthcheck_argv(name, compose["services"][name])
    with _grpc_health_server() as (port, servicer):
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert _run_probe(probe, port) == 0
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert _run_probe(probe, port) != 0
    assert _run_probe(probe, port) != 0  # nobody listening


def test_gateway_healthcheck_follows_http_health(compose: dict[str, Any]) -> None:
    status = {"code": 200}

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status["code"] if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        probe = healthcheck_argv("gateway", compose["services"]["gateway"])
        port = server.server_address[1]
        assert _run_probe(probe, port) == 0
        status["code"] = 503
        assert _run_probe(probe, port) != 0
    finally:
        server.shutdown()
        server.server_close()

"""The rendered stack held against the services' code: commands, addresses, ports, probes,
drains, secrets, resources and disruption budgets.

``check_stack`` parses every pdserve container's command with that service's own parser
and cross-checks what the services are told about each other; it returns a list of
problems (empty: the manifests agree with the code).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

from engine.engine_config import EngineConfig
from kvstore.master import master_argv
from services.scheduler.policy import HOST_LOCAL_TRANSPORTS
from tests.deploy.k8s_stack import (
    POD_IP,
    WORKLOAD_KINDS,
    Problem,
    Service,
    Stack,
    argv_of,
    declared_ports,
    match_labels,
    name_of,
    parse_container,
    pod_labels,
    pod_spec,
    quantity,
    selects,
    the_container,
)
from tests.service_argv import ALL_INTERFACES, PARSERS, WORKERS

REDIS_IMAGE = "redis"
REDIS_DATA = "/data"  # the redis image's working directory, where the AOF is written
MIN_STARTUP_S = 120  # the model load's allowance, as compose's start_period
DISRUPTED = ("services.gateway", *WORKERS)  # roles that need a PodDisruptionBudget


def image_name(image: str) -> str:
    return image.split("@")[0].rsplit(":", 1)[0] if ":" in image.split("/")[-1] else image


def check_stack(objects: list[dict[str, Any]]) -> list[str]:
    """Every way the rendered ``objects`` disagree with the services' code; empty if none."""
    stack = Stack(objects)
    problems: list[str] = []
    workloads = [o for o in objects if o["kind"] in WORKLOAD_KINDS]
    redis = [w for w in workloads
             if any(image_name(c.get("image", "")) == REDIS_IMAGE
                    for c in pod_spec(w).get("containers") or [])]  # fmt: skip
    if len(redis) != 1:
        problems.append(f"need exactly one redis workload, got {[name_of(w) for w in redis]}")
    stores = [w for w in workloads if _runs_kv_store_master(w)]
    if len(stores) != 1:
        problems.append(f"need exactly one KV store master, got {[name_of(w) for w in stores]}")
    services: dict[str, Service] = {}
    for w in workloads:
        if w in redis or w in stores:
            continue
        try:
            svc = parse_container(w, stack)
        except Problem as e:
            problems.append(str(e))
            continue
        if svc.module in services:
            problems.append(f"{svc.module} runs in both {services[svc.module].name} and {svc.name}")
        services[svc.module] = svc
    if len({s.container.get("image") for s in services.values()}) > 1:
        problems.append("the pdserve workloads must share one image")
    for w in workloads:
        try:
            problems += _check_pod(w)
        except Problem as e:
            problems.append(str(e))
    if missing := sorted(set(PARSERS) - set(services)):
        return [*problems, f"no workload runs {missing}"]

    for svc in services.values():
        problems += _check_common(svc, stack)
    if len(redis) == 1:
        problems += _check_redis(redis[0], stack)
        problems += _check_scheduler(services["services.scheduler"], redis[0], stack)
    sched_addrs = _service_addresses(services["services.scheduler"], stack)
    store_addrs: set[str] = set()
    if len(stores) == 1:
        found, store_addrs = _check_kv_store(stores[0], stack)
        problems += found
    for module in WORKERS:
        problems += _check_worker(services[module], services["services.scheduler"], sched_addrs)
        store = services[module].cfg.store
        if store.kv_store not in store_addrs or not store.enabled:
            problems.append(
                f"{services[module].name}: --kv-store {store.kv_store} (segment "
                f"{store.kv_store_segment_mib} MiB) is not in {sorted(store_addrs)}"
            )
    problems += _check_transports(services["services.prefill"], services["services.decode"])
    problems += _check_gateway(services["services.gateway"], sched_addrs, stack)
    problems += _check_k8s_services(stack, workloads, list(services.values()))
    problems += _check_budgets(stack, workloads, services)
    models = {m: s.cfg.engine.model for m, s in services.items() if m != "services.scheduler"}
    if len(set(models.values())) != 1:
        problems.append(f"services load different models: {models}")
    return problems


# --- every pod -----------------------------------------------------------------------------


def _check_pod(w: dict[str, Any]) -> list[str]:
    problems = []
    where = name_of(w)
    spec = pod_spec(w)
    if spec.get("automountServiceAccountToken") is not False:
        problems.append(f"{where}: mounts an API token it never uses")
    c = the_container(w)
    res = c.get("resources") or {}
    for kind in ("requests", "limits"):
        for what in ("cpu", "memory"):
            if what not in (res.get(kind) or {}):
                problems.append(f"{where}: no {kind}.{what}")
    try:
        for what in ("cpu", "memory"):
            if quantity(res["requests"][what]) > quantity(res["limits"][what]):
                problems.append(f"{where}: {what} request above its limit")
    except (KeyError, Problem):
        pass  # reported above
    if not c.get("readinessProbe"):
        problems.append(f"{where}: no readinessProbe")
    return problems


def _check_common(svc: Service, stack: Stack) -> list[str]:
    """What every pdserve container needs: its ports declared, the cluster token, probes,
    a grace period above its drain, scrape annotations."""
    problems = []
    spec = pod_spec(svc.workload)
    if spec.get("enableServiceLinks") is not False:
        problems.append(
            f"{svc.name}: service links inject <SERVICE>_* variables; a Service named "
            "pdserve-* would set PDSERVE_ settings"
        )
    for what, port in _listens(svc).items():
        if port not in svc.ports.values():
            problems.append(f"{svc.name}: {what} port {port} is not a declared containerPort")
    problems += _check_token(svc, stack)
    problems += _check_probes(svc)
    drain = svc.cfg.worker.drain_timeout_s if svc.module in WORKERS else svc.cfg.drain_timeout_s
    grace = spec.get("terminationGracePeriodSeconds", 30)
    pre_stop = _pre_stop_seconds(svc.container)
    if not grace > pre_stop + drain:
        problems.append(
            f"{svc.name}: terminationGracePeriodSeconds {grace} cuts preStop ({pre_stop}s) "
            f"+ drain ({drain}s) short"
        )
    notes = svc.workload["spec"]["template"]["metadata"].get("annotations") or {}
    want = {"prometheus.io/scrape": "true", "prometheus.io/path": "/metrics",
            "prometheus.io/port": str(metrics_port(svc))}  # fmt: skip
    if got := {k: notes.get(k) for k in want if notes.get(k) != want[k]}:
        problems.append(f"{svc.name}: scrape annotations {got}, the service serves {want}")
    return problems


def metrics_port(svc: Service) -> int:
    """Where the service serves Prometheus /metrics (0: nowhere)."""
    if svc.module == "services.gateway":
        return svc.cfg.http_port
    if svc.module == "services.scheduler":
        return svc.cfg.metrics_port
    return svc.cfg.worker.metrics_port


def _listens(svc: Service) -> dict[str, int]:
    """The ports the service binds, by what they are."""
    cfg = svc.cfg
    if svc.module == "services.gateway":
        return {"http": cfg.http_port, "grpc": cfg.grpc_port}
    if svc.module == "services.scheduler":
        return {"grpc": cfg.grpc_port, "metrics": cfg.metrics_port}
    out = {"grpc": cfg.worker.port, "metrics": cfg.worker.metrics_port}
    if svc.module == "services.decode" and cfg.transport == "tcp":
        out["kv"] = cfg.kv_port
    return out


def _pre_stop_seconds(container: dict[str, Any]) -> float:
    pre_stop = (container.get("lifecycle") or {}).get("preStop") or {}
    if "sleep" in pre_stop:
        return float(pre_stop["sleep"]["seconds"])
    command = (pre_stop.get("exec") or {}).get("command") or []
    if command[:1] == ["sleep"] and len(command) == 2:
        return float(command[1])
    if pre_stop:
        raise Problem(f"{container['name']}: a preStop hook the check cannot time: {pre_stop}")
    return 0.0


def _check_token(svc: Service, stack: Stack) -> list[str]:
    path = svc.cfg.cluster.cluster_token_file
    if not path:
        return [f"{svc.name}: no --cluster-token-file; internal calls would be open"]
    return _check_secret_file(svc, path, "--cluster-token-file", stack)


def _check_secret_file(svc: Service, path: str, flag: str, stack: Stack) -> list[str]:
    """The file ``flag`` names must be a key of a Secret mounted into the container."""
    directory, _, key = path.rpartition("/")
    mounts = {m["mountPath"].rstrip("/"): m["name"] for m in svc.container.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod_spec(svc.workload).get("volumes") or []}
    secret = (volumes.get(mounts.get(directory, "")) or {}).get("secret")
    if secret is None:
        return [f"{svc.name}: {flag} {path} is not in a mounted Secret"]
    if secret.get("items"):
        return [f"{svc.name}: Secret items remap keys; the check expects the keys as files"]
    if stack.secret_value(secret["secretName"], key) is None:
        return [f"{svc.name}: Secret {secret['secretName']} has no key {key} for {path}"]
    return []


def _check_probes(svc: Service) -> list[str]:
    problems = []
    c = svc.container
    if svc.module == "services.gateway":
        port = svc.cfg.http_port
        ready = (c.get("readinessProbe") or {}).get("httpGet") or {}
        if ready.get("path") != "/health" or svc.port(ready.get("port", -1)) != port:
            problems.append(f"{svc.name}: readinessProbe must GET /health on :{port}, got {ready}")
        live = c.get("livenessProbe") or {}
        if ((live.get("httpGet") or {}).get("path")) == "/health":
            problems.append(
                f"{svc.name}: liveness on /health restarts every gateway while the scheduler "
                "is down"
            )
        for kind in ("livenessProbe", "startupProbe"):
            probe = c.get(kind) or {}
            action = probe.get("tcpSocket") or probe.get("httpGet")
            if kind == "livenessProbe" and not action:
                problems.append(f"{svc.name}: no tcpSocket/httpGet livenessProbe")
            elif action and svc.port(action.get("port", -1)) != port:
                problems.append(f"{svc.name}: {kind} probes {action.get('port')}, not :{port}")
        return problems
    port = svc.cfg.grpc_port if svc.module == "services.scheduler" else svc.cfg.worker.port
    kinds = ["readinessProbe", "livenessProbe"]
    if svc.module in WORKERS:
        kinds.append("startupProbe")
        startup = c.get("startupProbe") or {}
        budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
        if startup and budget < MIN_STARTUP_S:
            problems.append(f"{svc.name}: startupProbe gives the model load {budget}s only")
    for kind in kinds:
        grpc_probe = (c.get(kind) or {}).get("grpc")
        if grpc_probe is None:
            problems.append(f"{svc.name}: {kind} must be a grpc (grpc.health.v1) probe")
        elif grpc_probe.get("port") != port or grpc_probe.get("service", ""):
            problems.append(f"{svc.name}: {kind} probes {grpc_probe}, the service is on :{port}")
    return problems


# --- each service --------------------------------------------------------------------------


def _service_addresses(target: Service, stack: Stack) -> set[str]:
    """``name:port`` of every Service port that reaches ``target``'s gRPC port."""
    grpc_port = target.cfg.grpc_port
    out = set()
    for s in stack.of("Service"):
        if not selects(s["spec"].get("selector"), pod_labels(target.workload)):
            continue
        for p in s["spec"].get("ports") or []:
            if target.port(p.get("targetPort", p["port"])) == grpc_port:
                out.add(f"{s['metadata']['name']}:{p['port']}")
    return out


def _check_redis(w: dict[str, Any], stack: Stack) -> list[str]:
    problems = []
    where = name_of(w)
    args = argv_of(the_container(w))
    if w["kind"] != "StatefulSet" or w["spec"].get("replicas", 1) != 1:
        problems.append(f"{where}: Redis must be a one-replica StatefulSet")
    if "--appendonly" not in args or args[args.index("--appendonly") + 1 :][:1] != ["yes"]:
        problems.append(f"{where}: without --appendonly yes a restart loses the request records")
    # A trust root of the scheduler's: a password, and memory capped below the limit so
    # Redis evicts rather than being OOM-killed into replaying the same AOF.
    if "--aclfile" not in args:
        problems.append(f"{where}: no --aclfile: anyone who reaches Redis logs in")
    if "--maxmemory" not in args or "--maxmemory-policy" not in args:
        problems.append(f"{where}: memory is not capped (--maxmemory, --maxmemory-policy)")
    else:
        cap = quantity(args[args.index("--maxmemory") + 1].removesuffix("b").upper() + "i")
        limit = quantity(((the_container(w).get("resources") or {}).get("limits") or {}).get(
            "memory", "0"))  # fmt: skip
        if not 0 < cap < limit:
            problems.append(f"{where}: --maxmemory must be under the memory limit")
    policies = [
        p for p in stack.of("NetworkPolicy")
        if selects(p["spec"].get("podSelector", {}).get("matchLabels"), pod_labels(w))
    ]  # fmt: skip
    if not policies:
        problems.append(f"{where}: no NetworkPolicy limits who reaches Redis")
    claims = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates") or []}
    mounts = {m["mountPath"]: m["name"] for m in the_container(w).get("volumeMounts") or []}
    if mounts.get(REDIS_DATA) not in claims:
        problems.append(f"{where}: {REDIS_DATA} is not on a volumeClaimTemplate")
    governing = stack.get("Service", w["spec"].get("serviceName", ""))
    if governing is None or governing["spec"].get("clusterIP") != "None":
        problems.append(f"{where}: serviceName must be a headless Service")
    return problems


def _runs_kv_store_master(w: dict[str, Any]) -> bool:
    containers = pod_spec(w).get("containers") or []
    return len(containers) == 1 and (containers[0].get("command") or [None])[0] == "mooncake_master"


def _check_kv_store(w: dict[str, Any], stack: Stack) -> tuple[list[str], set[str]]:
    """The store's master: one replica never overlapping another, on ``kvstore.master``'s
    command line; returns the problems and the ``name:port`` of Services reaching it."""
    problems = []
    where = name_of(w)
    container = the_container(w)
    args = [str(a) for a in container.get("args") or []]
    flags = dict(a.split("=", 1) for a in args if "=" in a)
    if w["kind"] != "Deployment" or w["spec"].get("replicas") != 1:
        problems.append(f"{where}: the KV store's master must be a Deployment of 1 replica")
    if (w["spec"].get("strategy") or {}).get("type") != "Recreate":
        problems.append(f"{where}: a rolling update would run two masters; use Recreate")
    try:
        port, metrics = int(flags["--rpc_port"]), int(flags["--metrics_port"])
    except (KeyError, ValueError):
        return [
            *problems,
            f"{where}: mooncake_master needs --rpc_port=N and --metrics_port=N",
        ], set()
    want = master_argv(port, metrics_port=metrics)[1:]
    if args != want:
        problems.append(f"{where}: mooncake_master {args} is not kvstore.master's {want}")
    ports = declared_ports(container)
    reach = set()
    for s in stack.of("Service"):
        if selects(s["spec"].get("selector"), pod_labels(w)):
            for p in s["spec"].get("ports") or []:
                target = p.get("targetPort", p["port"])
                if ports.get(target, target) == port:
                    reach.add(f"{s['metadata']['name']}:{p['port']}")
    if not reach:
        problems.append(f"{where}: no Service reaches its port {port}")
    return problems, reach


def _check_scheduler(sched: Service, redis: dict[str, Any], stack: Stack) -> list[str]:
    problems = []
    w = sched.workload
    if w["kind"] != "Deployment" or w["spec"].get("replicas") != 1:
        problems.append(f"{sched.name}: the scheduler must be a Deployment of exactly 1 replica")
    if (w["spec"].get("strategy") or {}).get("type") != "Recreate":
        problems.append(f"{sched.name}: a rolling update would run two schedulers; use Recreate")
    if sched.cfg.grpc_host not in ALL_INTERFACES:
        problems.append(f"{sched.name}: binds {sched.cfg.grpc_host}; other pods cannot reach it")
    if not sched.cfg.metrics_port:
        problems.append(f"{sched.name}: --metrics-port 0 exports no metrics")
    args = argv_of(the_container(redis))
    redis_port = int(args[args.index("--port") + 1]) if "--port" in args else 6379
    reach = set()
    for s in stack.of("Service"):
        if selects(s["spec"].get("selector"), pod_labels(redis)):
            redis_ports = declared_ports(the_container(redis))
            for p in s["spec"].get("ports") or []:
                target = p.get("targetPort", p["port"])
                if redis_ports.get(target, target) == redis_port:
                    reach.add((s["metadata"]["name"], p["port"]))
    if not sched.cfg.redis_username or not sched.cfg.redis_password_file:
        problems.append(f"{sched.name}: logs in to Redis without --redis-username/-password-file")
    else:
        problems += _check_secret_file(
            sched, sched.cfg.redis_password_file, "--redis-password-file", stack
        )
    url = urlparse(sched.cfg.redis_url)
    if url.scheme != "redis" or (url.hostname, url.port or 6379) not in reach:
        problems.append(
            f"{sched.name}: --redis-url {sched.cfg.redis_url} reaches no Service of Redis's "
            f"port {redis_port} (those: {sorted(reach)})"
        )
    return problems


def _check_worker(svc: Service, sched: Service, sched_addrs: set[str]) -> list[str]:
    problems = []
    w = svc.cfg.worker
    if w.host not in ALL_INTERFACES:
        problems.append(f"{svc.name}: binds {w.host}; other pods cannot reach it")
    if w.advertise_host != POD_IP:
        problems.append(
            f"{svc.name}: --advertise-host {w.advertise_host} is not the pod IP "
            "($(POD_IP) from status.podIP)"
        )
    if w.worker_id is not None:
        problems.append(f"{svc.name}: --worker-id {w.worker_id} is shared by every replica")
    if w.scheduler not in sched_addrs:
        problems.append(f"{svc.name}: --scheduler {w.scheduler} is not in {sorted(sched_addrs)}")
    if not w.heartbeat_interval_s < sched.cfg.heartbeat_ttl_s:
        problems.append(
            f"{svc.name}: heartbeats every {w.heartbeat_interval_s}s, "
            f"lease is {sched.cfg.heartbeat_ttl_s}s"
        )
    if not w.metrics_port:
        problems.append(f"{svc.name}: --metrics-port 0 exports no metrics (the HPAs need them)")
    if svc.workload["kind"] != "Deployment":
        problems.append(f"{svc.name}: workers are a Deployment")
    cpus = quantity(((svc.container.get("resources") or {}).get("limits") or {}).get("cpu", 0))
    want = EngineConfig(threads=int(cpus) or None)
    if svc.cfg.engine != want or cpus != int(cpus):
        problems.append(
            f"{svc.name}: engine settings {svc.cfg.engine} are not {want} (one torch thread "
            f"per core of its {cpus} CPU limit)"
        )
    return problems


def _check_transports(prefill: Service, decode: Service) -> list[str]:
    """The KV path between pods: no host-local transport, one both sides share, and the
    decode worker's receiver on a fixed, declared port."""
    p, d = prefill.cfg, decode.cfg
    problems = []
    if host_local := [t for t in p.transports if t in HOST_LOCAL_TRANSPORTS]:
        problems.append(f"{prefill.name}: --transports {host_local} do not work across pods")
    if d.role != "decode":
        problems.append(f"{decode.name}: --role {d.role}; the stack needs decode workers")
    if d.transport in HOST_LOCAL_TRANSPORTS:
        problems.append(f"{decode.name}: --transport {d.transport} does not work across pods")
    if d.transport not in p.transports:
        problems.append(f"{prefill.name} cannot write KV over {decode.name}'s {d.transport}")
    if d.transport == "tcp" and not d.kv_port:
        problems.append(f"{decode.name}: --kv-port 0 picks a port no manifest declares")
    return problems


def _check_gateway(gw: Service, sched_addrs: set[str], stack: Stack) -> list[str]:
    problems = []
    cfg = gw.cfg
    if cfg.backend != "cluster":
        problems.append(f"{gw.name}: --backend {cfg.backend}; the stack needs the cluster backend")
    if cfg.scheduler not in sched_addrs:
        problems.append(f"{gw.name}: --scheduler {cfg.scheduler} is not in {sorted(sched_addrs)}")
    if cfg.host not in ALL_INTERFACES:
        problems.append(f"{gw.name}: binds {cfg.host}; its Service would not reach it")
    if not cfg.api_keys:
        problems.append(f"{gw.name}: no API keys (PDSERVE_GATEWAY_API_KEYS from a Secret)")
    exposed = set()
    for s in stack.of("Service"):
        if selects(s["spec"].get("selector"), pod_labels(gw.workload)):
            exposed |= {gw.port(p.get("targetPort", p["port"])) for p in s["spec"]["ports"]}
    if missing := {cfg.http_port, cfg.grpc_port} - exposed:
        problems.append(f"{gw.name}: no Service exposes its port(s) {sorted(missing)}")
    return problems


# --- Services and budgets ------------------------------------------------------------------


def _check_k8s_services(
    stack: Stack, workloads: list[dict[str, Any]], services: list[Service]
) -> list[str]:
    """Each Service selects exactly one workload's pods, on ports those pods declare."""
    problems = []
    for s in stack.of("Service"):
        where = name_of(s)
        picked = [w for w in workloads if selects(s["spec"].get("selector"), pod_labels(w))]
        if len(picked) != 1:
            problems.append(f"{where}: selects {[name_of(w) for w in picked]}, want one workload")
            continue
        declared = declared_ports(the_container(picked[0]))
        for p in s["spec"].get("ports") or []:
            target = p.get("targetPort", p["port"])
            if target not in declared and target not in declared.values():
                problems.append(f"{where}: targetPort {target} is no port of {name_of(picked[0])}")
    return problems


def _check_budgets(
    stack: Stack, workloads: list[dict[str, Any]], services: dict[str, Service]
) -> list[str]:
    problems = []
    covered: dict[str, list[str]] = {}
    for pdb in stack.of("PodDisruptionBudget"):
        where = name_of(pdb)
        try:
            sel = match_labels(pdb["spec"].get("selector") or {})
        except Problem as e:
            problems.append(f"{where}: {e}")
            continue
        picked = [w for w in workloads if selects(sel, pod_labels(w))]
        if len(picked) != 1:
            problems.append(f"{where}: selects {[name_of(w) for w in picked]}, want one workload")
            continue
        covered.setdefault(name_of(picked[0]), []).append(where)
        budget = pdb["spec"].get("maxUnavailable")
        if not isinstance(budget, int) or budget < 1:
            problems.append(f"{where}: give maxUnavailable >= 1, or drains can never evict")
    for module in DISRUPTED:
        if len(covered.get(name_of(services[module].workload), [])) != 1:
            problems.append(f"{services[module].name}: needs exactly one PodDisruptionBudget")
    sched = name_of(services["services.scheduler"].workload)
    if sched in covered:
        problems.append(f"{sched}: a budget on a single replica blocks node drains or is moot")
    return problems

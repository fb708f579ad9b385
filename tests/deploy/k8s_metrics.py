"""The metrics path of the manifests held against the code: the series the workers export,
the Prometheus adapter's rules that turn them into custom metrics, the HPAs that scale on
those, and the two ways Prometheus finds the pods (ServiceMonitor, annotation-based
scrape config, the latter run through Prometheus' relabelling rules).

Each ``check_*`` returns a list of problems; empty: the manifests agree with the code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

from services.common import metrics as worker_metrics
from tests.deploy.k8s_checks import metrics_port
from tests.deploy.k8s_stack import (
    POD_FIELDS,
    POD_IP,
    WORKLOAD_KINDS,
    Problem,
    Service,
    Stack,
    match_labels,
    name_of,
    pod_labels,
    quantity,
    selects,
)
from tests.service_argv import WORKERS

# Labels the scrape adds to every series; the adapter maps them to Kubernetes objects.
TARGET_LABELS = {"namespace": "namespace", "pod": "pod"}
_SAMPLE_SUFFIXES = {"gauge": ("",), "counter": ("_total",),
                    "histogram": ("_bucket", "_sum", "_count")}  # fmt: skip


@dataclass(frozen=True)
class Series:
    """One exported sample name of a worker metric."""

    name: str
    type: str
    labels: tuple[str, ...]


def worker_series() -> dict[str, Series]:
    """Every sample name a prefill or decode worker exports on ``/metrics``: the metrics of
    ``services.common.metrics``, registered on prometheus_client's default ``REGISTRY``
    (the registry ``start_metrics`` serves for workers)."""
    registered = {family.name for family in REGISTRY.collect()}
    out = {}
    for metric in vars(worker_metrics).values():
        if not isinstance(metric, MetricWrapperBase):
            continue
        (family,) = metric.describe()
        assert family.name in registered, f"{family.name} is not on the default REGISTRY"
        # Label names live only on the metric object: a family without samples has none.
        labels = tuple(metric._labelnames)
        for suffix in _SAMPLE_SUFFIXES[family.type]:
            out[family.name + suffix] = Series(family.name + suffix, family.type, labels)
    return out


# --- the adapter's rules -------------------------------------------------------------------


@dataclass(frozen=True)
class AdapterRule:
    """One Prometheus adapter rule, read: the series it discovers and the metric it serves."""

    series: str
    matchers: dict[str, tuple[str, str]]  # label -> (operator, value)
    metric: str
    rule: dict[str, Any]

    @property
    def role(self) -> str | None:
        op, value = self.matchers.get("role", ("", ""))
        return value if op == "=" else None


def _go_template(template: str) -> str:
    """A Go regexp replacement (``$1``, ``${1}``) as a Python one."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: rf"\g<{m.group(1) or m.group(2)}>", template)


def read_rules(config: dict[str, Any]) -> list[AdapterRule]:
    """The adapter config's ``rules``; ``Problem`` when one cannot be read."""
    rules = []
    for rule in config.get("rules") or []:
        m = re.fullmatch(r"\s*([a-zA-Z_:][\w:]*)\s*\{(.*)\}\s*", rule.get("seriesQuery", ""))
        if m is None:
            raise Problem(f"adapter: seriesQuery {rule.get('seriesQuery')!r} is not name{{...}}")
        matchers = {label: (op, value) for label, op, value
                    in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', m.group(2))}  # fmt: skip
        naming = rule.get("name") or {}
        pattern = naming.get("matches", "")
        if not re.search(pattern, m.group(1)):
            raise Problem(f"adapter: name.matches {pattern!r} does not match {m.group(1)}")
        metric = re.sub(pattern, _go_template(naming.get("as", "")), m.group(1))
        rules.append(AdapterRule(m.group(1), matchers, metric, rule))
    return rules


def check_adapter(rules: list[AdapterRule], exported: dict[str, Series]) -> list[str]:
    problems = []
    seen: set[str] = set()
    for r in rules:
        where = f"adapter rule {r.series}"
        series = exported.get(r.series)
        if series is None:
            problems.append(f"{where}: no worker exports {r.series}")
            continue
        if series.type != "gauge":
            problems.append(f"{where}: a {series.type}; the query takes no rate(), want a gauge")
        if unknown := set(r.matchers) - set(series.labels) - set(TARGET_LABELS):
            problems.append(f"{where}: {r.series} has no label(s) {sorted(unknown)}")
        if r.role not in ("prefill", "decode"):
            problems.append(f'{where}: must keep one role\'s series (role="...")')
        overrides = (r.rule.get("resources") or {}).get("overrides") or {}
        for label, resource in TARGET_LABELS.items():
            if r.matchers.get(label) != ("!=", ""):
                problems.append(f'{where}: seriesQuery must require {label}!=""')
            if (overrides.get(label) or {}).get("resource") != resource:
                problems.append(f"{where}: label {label} must map to resource {resource}")
        query = r.rule.get("metricsQuery", "")
        for part in ("<<.Series>>", "<<.LabelMatchers>>", "by (<<.GroupBy>>)", f'role="{r.role}"'):
            if part not in query:
                problems.append(f"{where}: metricsQuery lacks {part}")
        if ":" in r.metric or r.metric in seen:
            problems.append(f"{where}: serves {r.metric!r}: a colon, or a name served twice")
        seen.add(r.metric)
    return problems


# --- the autoscalers -----------------------------------------------------------------------


def _bounds(series: str, target: Service, services: dict[str, Service]) -> tuple[float, str]:
    """An exclusive upper bound of a sensible target for ``series``, and why."""
    if series == "pdserve:num_prompt_tokens_waiting":
        cap = services["services.scheduler"].cfg.max_queued_prompt_tokens
        return cap, "the scheduler refuses placements past --max-queued-prompt-tokens"
    if series == "pdserve:kv_cache_usage_perc":
        return 1.0, "it is a fraction of the KV pool"
    if series == "pdserve:batch_target_usage_perc":
        return 1.0, "past 1 sequences wait for the batch target"
    raise Problem(f"no known bound for an HPA target on {series}")


def check_autoscaling(
    stack: Stack, rules: list[AdapterRule], services: dict[str, Service]
) -> list[str]:
    """Each worker role has an HPA on its own custom metrics, with targets below the limits
    at which the services refuse or queue work."""
    problems = []
    by_metric = {r.metric: r for r in rules}
    by_workload = {s.name: s for s in services.values()}
    scaled = set()
    for hpa in stack.of("HorizontalPodAutoscaler"):
        where = name_of(hpa)
        spec = hpa["spec"]
        ref = spec["scaleTargetRef"]
        target = by_workload.get(ref["name"]) if ref.get("kind") == "Deployment" else None
        if target is None or target.module not in WORKERS:
            problems.append(f"{where}: scales {ref}, not a worker Deployment")
            continue
        scaled.add(target.module)
        if "replicas" in target.workload["spec"]:
            problems.append(f"{where}: {ref['name']} sets spec.replicas; each apply resets the HPA")
        if not 1 <= spec.get("minReplicas", 1) <= spec["maxReplicas"]:
            problems.append(f"{where}: want 1 <= minReplicas <= maxReplicas")
        role = target.cfg.role if target.module == "services.decode" else "prefill"
        for m in spec.get("metrics") or []:
            if m.get("type") != "Pods":
                problems.append(f"{where}: a {m.get('type')} metric; the workers' are per pod")
                continue
            name = m["pods"]["metric"]["name"]
            rule = by_metric.get(name)
            if rule is None:
                problems.append(f"{where}: no adapter rule serves {name}")
                continue
            if rule.role != role:
                problems.append(f"{where}: {name} is the {rule.role} role's, this scales {role}")
            goal = m["pods"]["target"]
            if goal.get("type") != "AverageValue":
                problems.append(f"{where}: {name} needs an AverageValue target")
                continue
            try:
                high, why = _bounds(rule.series, target, services)
                if not 0 < quantity(goal["averageValue"]) < high:
                    problems.append(
                        f"{where}: {name} target {goal['averageValue']} not in (0, {high}): {why}"
                    )
            except Problem as e:
                problems.append(f"{where}: {e}")
    if missing := sorted(set(WORKERS) - scaled):
        problems.append(f"no HPA scales {missing}")
    return problems


# --- how Prometheus finds the pods ---------------------------------------------------------


def check_service_monitor(
    monitors: list[dict[str, Any]], stack: Stack, services: dict[str, Service]
) -> list[str]:
    """Every pdserve service's metrics port is some ServiceMonitor endpoint's target."""
    problems = []
    for svc in services.values():
        want = metrics_port(svc)
        found = False
        namespace = svc.workload["metadata"].get("namespace")
        for s in stack.of("Service"):
            if not selects(s["spec"].get("selector"), pod_labels(svc.workload)):
                continue
            for sm in monitors:
                names = ((sm["spec"].get("namespaceSelector") or {}).get("matchNames")
                         or [sm["metadata"].get("namespace")])  # fmt: skip
                labels = s["metadata"].get("labels") or {}
                picked = selects(match_labels(sm["spec"]["selector"]), labels)
                if namespace not in names or not picked:
                    continue
                for ep in sm["spec"]["endpoints"]:
                    ports = [p for p in s["spec"]["ports"] if p.get("name") == ep.get("port")]
                    found |= any(
                        svc.port(p.get("targetPort", p["port"])) == want
                        and ep.get("path", "/metrics") == "/metrics"
                        for p in ports
                    )
        if not found:
            problems.append(f"{svc.name}: no ServiceMonitor endpoint scrapes its :{want}/metrics")
    return problems


def _meta(prefix: str, mapping: dict[str, str]) -> dict[str, str]:
    return {prefix + re.sub(r"[^a-zA-Z0-9_]", "_", k): v for k, v in mapping.items()}


def relabel(labels: dict[str, str], configs: list[dict[str, Any]]) -> dict[str, str] | None:
    """Prometheus' ``relabel_configs`` (keep, drop, replace) on one target; None: dropped."""
    labels = dict(labels)
    for cfg in configs:
        action = cfg.get("action", "replace")
        sources = cfg.get("source_labels") or []
        value = cfg.get("separator", ";").join(labels.get(s, "") for s in sources)
        m = re.fullmatch(cfg.get("regex", "(.*)"), value)  # Prometheus anchors the regex
        if (action == "keep" and m is None) or (action == "drop" and m is not None):
            return None
        if action == "replace" and m is not None:
            result = m.expand(_go_template(cfg.get("replacement", "$1")))
            if result:
                labels[cfg["target_label"]] = result
            else:
                labels.pop(cfg["target_label"], None)
        elif action not in ("keep", "drop", "replace"):
            raise Problem(f"relabel action {action} is not modelled")
    return labels


def pod_targets(workload: dict[str, Any]) -> list[dict[str, str]]:
    """What Prometheus' kubernetes_sd pod role discovers for one pod of ``workload``: a
    target per declared container port (one at the bare pod IP when none)."""
    template = workload["spec"]["template"]
    common = {
        "__meta_kubernetes_namespace": workload["metadata"].get("namespace", "default"),
        "__meta_kubernetes_pod_name": POD_FIELDS["metadata.name"],
        "__meta_kubernetes_pod_ip": POD_IP,
        "__metrics_path__": "/metrics",
        **_meta("__meta_kubernetes_pod_annotation_", template["metadata"].get("annotations") or {}),
        **_meta("__meta_kubernetes_pod_label_", template["metadata"].get("labels") or {}),
    }
    ports = [p for c in template["spec"]["containers"] for p in c.get("ports") or []]
    if not ports:
        return [{**common, "__address__": POD_IP}]
    return [{**common, "__address__": f"{POD_IP}:{p['containerPort']}",
             "__meta_kubernetes_pod_container_port_number": str(p["containerPort"]),
             "__meta_kubernetes_pod_container_port_name": p.get("name", "")}
            for p in ports]  # fmt: skip


def check_scrape_config(
    config: dict[str, Any], stack: Stack, services: dict[str, Service]
) -> list[str]:
    """The annotation-based job, run over each pod's discovered targets: every pdserve pod
    ends up as one target at its metrics port, labelled with namespace and pod."""
    problems = []
    jobs = config.get("scrape_configs") or []
    if len(jobs) != 1:
        return [f"scrape config: want one job, got {len(jobs)}"]
    job = jobs[0]
    sd = [c for c in job.get("kubernetes_sd_configs") or [] if c.get("role") == "pod"]
    watched = {n for c in sd for n in ((c.get("namespaces") or {}).get("names") or [])}
    by_workload = {s.name: s for s in services.values()}
    for w in (o for o in stack.objects if o["kind"] in WORKLOAD_KINDS):
        svc = by_workload.get(w["metadata"]["name"])
        if svc is not None and sd and watched and w["metadata"].get("namespace") not in watched:
            problems.append(f"scrape config: does not watch {svc.name}'s namespace")
        try:
            relabelled = [relabel(t, job.get("relabel_configs") or []) for t in pod_targets(w)]
        except Problem as e:
            return [f"scrape config: {e}"]
        # What is left once the __meta_ labels go; Prometheus keeps one of equal targets.
        public = {tuple(sorted((k, v) for k, v in t.items() if not k.startswith("__meta_")))
                  for t in relabelled if t is not None}  # fmt: skip
        if svc is None:
            continue
        want = (f"{POD_IP}:{metrics_port(svc)}", "/metrics")
        got = {(dict(t)["__address__"], dict(t).get("__metrics_path__")) for t in public}
        if got != {want}:
            problems.append(f"scrape config: {svc.name} is scraped at {sorted(got)}, not {want}")
        for label, field in (("namespace", "metadata.namespace"), ("pod", "metadata.name")):
            values = {dict(t).get(label) for t in public}
            if label == "namespace":
                expected = w["metadata"].get("namespace", "default")
            else:
                expected = POD_FIELDS[field]
            if public and values != {expected}:
                problems.append(f"scrape config: {svc.name}'s series get {label}={values}")
    return problems

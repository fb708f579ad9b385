"""Check a Grafana dashboard against the metrics pdserve exports.

The exported families come from the metric objects themselves (the workers' module-level
instruments, a fresh ``SchedulerMetrics`` and ``GatewayMetrics``), never from a list kept
by hand, so renaming a metric in the code without the dashboard fails here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from tests.deploy.promql import selectors

# The sample names prometheus_client serves for each family type.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}
# Series Prometheus writes itself for every target, and the labels it attaches.
PROMETHEUS_SERIES = {"up": "gauge"}
TARGET_LABELS = frozenset({"job", "instance"})
# Grafana's own variables.
GRAFANA_VARIABLES = frozenset({"__rate_interval", "__interval", "__range", "__interval_ms"})


@dataclass(frozen=True)
class Family:
    name: str
    type: str
    labels: frozenset[str]


def exported_families() -> dict[str, list[Family]]:
    """Family name -> every exporter's family of that name (workers and the gateway both
    export ``pdserve:time_to_first_token_seconds``, with different labels)."""
    import services.common.metrics as worker
    from services.gateway.metrics import GatewayMetrics
    from services.scheduler.metrics import SchedulerMetrics

    wrappers = [v for v in vars(worker).values() if isinstance(v, MetricWrapperBase)]
    wrappers += _wrappers(vars(SchedulerMetrics(CollectorRegistry())).values())
    wrappers += _wrappers(vars(GatewayMetrics("m")).values())
    out: dict[str, list[Family]] = {}
    for w in wrappers:
        for metric in w.collect():
            family = Family(metric.name, metric.type, frozenset(w._labelnames))
            out.setdefault(metric.name, []).append(family)
    return out


def _wrappers(values: Iterable[Any]) -> list[MetricWrapperBase]:
    return [v for v in values if isinstance(v, MetricWrapperBase)]


def served_names(families: dict[str, list[Family]]) -> dict[str, list[Family]]:
    """Sample name as served (``x_total``, ``x_bucket``, ...) -> the families serving it."""
    out: dict[str, list[Family]] = {}
    for name, fams in families.items():
        for fam in fams:
            for suffix in SUFFIXES[fam.type]:
                out.setdefault(name + suffix, []).append(fam)
    for name, kind in PROMETHEUS_SERIES.items():
        out[name] = [Family(name, kind, frozenset())]
    return out


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def problems(dashboard: dict[str, Any], served: dict[str, list[Family]]) -> list[str]:
    """What is wrong with ``dashboard``, one line each; empty when it is sound."""
    out: list[str] = []
    variables = {v["name"] for v in dashboard.get("templating", {}).get("list", [])}
    if "datasource" not in variables:
        out.append("no ${datasource} template variable")
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            out += [
                f"variable ${var['name']}: {p}" for p in variable_problems(var, served, variables)
            ]
    seen: set[int] = set()
    for panel in panels(dashboard):
        where = f"panel {panel.get('id')} {panel.get('title', '')!r}"
        if not isinstance(panel.get("id"), int) or panel["id"] in seen:
            out.append(f"{where}: id missing or not unique")
        seen.add(panel.get("id"))
        if panel.get("type") == "row":
            continue
        if not panel.get("datasource"):
            out.append(f"{where}: no datasource")
        if not panel.get("targets"):
            out.append(f"{where}: no targets")
        for target in panel.get("targets", []):
            expr = target.get("expr", "")
            out += [f"{where}: {p}" for p in expr_problems(expr, served, variables)]
    return out


def expr_problems(expr: str, served: dict[str, list[Family]], variables: set[str]) -> list[str]:
    """What is wrong with one PromQL expression: names nothing exports, a label the metric
    lacks, a quantile over anything but a histogram's ``_bucket``, an unknown variable."""
    if not expr.strip():
        return ["empty expr"]
    for var in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", expr):
        if var not in variables | GRAFANA_VARIABLES:
            return [f"unknown variable ${var} in {expr!r}"]
    try:
        found = selectors(expr)
    except ValueError as e:
        return [str(e)]
    if not found:
        return [f"selects no metric: {expr!r}"]
    out = []
    for sel in found:
        if not sel.name:
            out.append(f"a selector without a metric name cannot be checked: {expr!r}")
            continue
        fams = served.get(sel.name)
        if fams is None:
            out.append(f"{sel.name} is not exported")
            continue
        labels = set().union(*(f.labels for f in fams)) | TARGET_LABELS
        if sel.name.endswith("_bucket"):
            labels.add("le")
        out += [
            f"{sel.name} has no label {label!r}"
            for label, _, _ in sel.matchers
            if label not in labels
        ]
        if sel.in_quantile and not (
            sel.name.endswith("_bucket") and all(f.type == "histogram" for f in fams)
        ):
            out.append(f"histogram_quantile over {sel.name}, not a histogram's _bucket")
    return out


def variable_problems(
    var: dict[str, Any], served: dict[str, list[Family]], variables: set[str]
) -> list[str]:
    """A query variable must be Grafana's ``label_values(selector, label)`` over an exported
    series that carries ``label``."""
    query = var.get("query", {})
    text = query.get("query", "") if isinstance(query, dict) else query
    m = re.fullmatch(r"\s*label_values\((.+),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*", text)
    if m is None:
        return [f"not label_values(selector, label): {text!r}"]
    selector, label = m.groups()
    out = expr_problems(selector, served, variables)
    if not out:
        fams = served[selectors(selector)[0].name]
        if label not in set().union(*(f.labels for f in fams)) | TARGET_LABELS:
            out.append(f"{selectors(selector)[0].name} has no label {label!r}")
    return out

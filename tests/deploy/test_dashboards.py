"""The Grafana dashboard and the Prometheus config in deploy/ against the code: every series
a panel selects is one the services export (with that label, as served), quantiles read
histograms' buckets, and the scrape config matches compose's ports."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.dashboard_check import (
    exported_families,
    panels,
    problems,
    served_names,
)
from tests.deploy.promql import selectors
from tests.prometheus_server import needs_prometheus, query, start_prometheus

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/pdserve.json"
PROMETHEUS_YML = ROOT / "deploy/prometheus/prometheus.yml"
COMPOSE = ROOT / "compose/docker-compose.yml"


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def served() -> dict:
    return served_names(exported_families())


def exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]


def test_the_dashboard_selects_only_what_the_services_export(dashboard, served) -> None:
    assert problems(dashboard, served) == []
    assert dashboard["schemaVersion"] >= 36 and len(exprs(dashboard)) >= 20


def test_exported_names_come_from_the_metric_objects(served) -> None:
    # Both exporters of TTFT are seen, each with its own labels; counters end in _total.
    ttft = served["pdserve:time_to_first_token_seconds_bucket"]
    assert {frozenset(f.labels) for f in ttft} == {frozenset({"role"}), frozenset({"model_name"})}
    assert "pdserve:request_goodput_total" in served
    assert "pdserve_scheduler_queue_depth" in served
    assert "pdserve:migrations" not in served and "pdserve:migrations_total" in served


@pytest.mark.parametrize(
    ("old", "new", "reported"),
    [
        ("pdserve:kv_cache_usage_perc{", "pdserve:kv_cache_usage_pct{", "is not exported"),
        ("pdserve:migrations_total", "pdserve:migrations", "is not exported"),
        (  # a counter has no buckets
            "pdserve:kv_transfer_seconds_bucket",
            "pdserve:kv_transfer_bytes_total_bucket",
            "is not exported",
        ),
        (  # a histogram's _sum is no input for a quantile
            "pdserve:kv_transfer_seconds_bucket",
            "pdserve:kv_transfer_seconds_sum",
            "histogram_quantile over pdserve:kv_transfer_seconds_sum",
        ),
        (
            'pdserve:requests_total{status!~"2..|OK"}',
            'pdserve:requests_total{role="x"}',
            "has no label 'role'",
        ),
        (
            "pdserve_scheduler_queue_depth",
            'pdserve_scheduler_queue_depth{le="1"}',
            "has no label 'le'",
        ),
        ("[$__rate_interval]", "[$window]", "unknown variable $window"),
        (
            "pdserve_scheduler_queue_depth",
            '{__name__="pdserve_scheduler_queue_depth"}',
            "without a metric name",
        ),
        (
            "sum(rate(pdserve:request_goodput_total",
            "sum((rate(pdserve:request_goodput_total",
            "unclosed",
        ),
    ],
)
def test_a_broken_expression_is_reported(dashboard, served, old, new, reported) -> None:
    broken = json.loads(
        json.dumps(dashboard).replace(json.dumps(old)[1:-1], json.dumps(new)[1:-1], 1)
    )
    assert broken != dashboard, f"{old!r} is not in the dashboard"
    found = problems(broken, served)
    assert len(found) == 1 and reported in found[0], found


def test_panel_ids_datasources_and_the_datasource_variable_are_required(dashboard, served) -> None:
    broken = copy.deepcopy(dashboard)
    graphs = [p for p in broken["panels"] if p["type"] != "row"]
    graphs[1]["id"] = graphs[0]["id"]
    del graphs[2]["datasource"]
    broken["templating"]["list"] = [
        v for v in broken["templating"]["list"] if v["name"] != "datasource"
    ]
    found = "\n".join(problems(broken, served))
    assert "id missing or not unique" in found
    assert f"panel {graphs[2]['id']} {graphs[2]['title']!r}: no datasource" in found
    assert "no ${datasource} template variable" in found


def test_the_reader_skips_functions_keywords_labels_and_durations() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, role) (rate(a_bucket{role=~"$role"}'
        "[$__rate_interval]))) / on(job) group_left(x) sum without (y) (b_total offset 5m)"
        " > bool 1e3 and up"
    )
    got = [(s.name, s.matchers, s.in_quantile) for s in selectors(expr)]
    assert got == [
        ("a_bucket", (("role", "=~", '"$role"'),), True),
        ("b_total", (), False),
        ("up", (), False),
    ]


def _touch_every_metric(wrappers: list[MetricWrapperBase]) -> None:
    """One child of each metric, given a value, so every family has samples to serve."""
    for w in wrappers:
        child = w.labels(*["dashboard-test"] * len(w._labelnames)) if w._labelnames else w
        {"counter": lambda c: c.inc(), "gauge": lambda c: c.set(1),
         "histogram": lambda c: c.observe(0.01)}[w._type](child)  # fmt: skip


def test_the_served_expositions_hold_every_series_the_dashboard_names(dashboard) -> None:
    """Through the /metrics server the workers and the scheduler use, asked as Prometheus
    asks, and the gateway's /metrics body: the names as a scraper stores them."""
    import services.common.metrics as worker
    from services.common.process import serve_metrics
    from services.gateway.metrics import GatewayMetrics
    from services.scheduler.metrics import SchedulerMetrics
    from tests.scrape import PROMETHEUS_ACCEPT

    scheduler = SchedulerMetrics(CollectorRegistry())
    gateway = GatewayMetrics("m")
    for metrics in (vars(worker), vars(scheduler), vars(gateway)):
        _touch_every_metric([v for v in metrics.values() if isinstance(v, MetricWrapperBase)])
    texts = [gateway.render().decode()]
    for registry in (REGISTRY, scheduler.registry):
        server = serve_metrics("127.0.0.1", 0, registry)
        try:
            url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
            req = urllib.request.Request(url, headers={"Accept": PROMETHEUS_ACCEPT})
            with urllib.request.urlopen(req, timeout=5) as r:
                texts.append(r.read().decode())
        finally:
            server.shutdown()
            server.server_close()
    scraped = {s.name for t in texts for f in text_string_to_metric_families(t) for s in f.samples}
    named = {s.name for e in exprs(dashboard) for s in selectors(e)} - {"up"}
    assert named - scraped == set()


def _command_flag(service: dict[str, Any], flag: str) -> int:
    return int(next(a.split("=", 1)[1] for a in service["command"] if a.startswith(f"{flag}=")))


def test_the_scrape_config_follows_compose_and_pdserve_up() -> None:
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    compose = yaml.safe_load(COMPOSE.read_text())["services"]
    ports = {}
    for job in config["scrape_configs"]:
        for sd in job.get("static_configs", []):
            ports[job["job_name"]] = [t.rsplit(":", 1) for t in sd["targets"]]
        for sd in job.get("dns_sd_configs", []):
            ports[job["job_name"]] = [[n, str(sd["port"])] for n in sd["names"]]
    # pdserve up --prometheus names its jobs the same way (services/up.py), so one
    # dashboard serves both stacks.
    assert set(ports) == {"gateway", "scheduler", "prefill", "decode"}
    expected = {
        "gateway": _command_flag(compose["gateway"], "--http-port"),
        "scheduler": _command_flag(compose["scheduler"], "--metrics-port"),
        "prefill": _command_flag(compose["prefill"], "--metrics-port"),
        "decode": _command_flag(compose["decode"], "--metrics-port"),
    }
    assert ports == {job: [[job, str(port)]] for job, port in expected.items()}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_scrape_config() -> None:
    done = subprocess.run(["promtool", "check", "config", str(PROMETHEUS_YML)], capture_output=True)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_prometheus
def test_a_real_prometheus_parses_every_panel_query(dashboard, tmp_path) -> None:
    stack, base = start_prometheus(tmp_path, {})
    try:
        for expr in exprs(dashboard):
            plain = re.sub(r"\$__rate_interval", "1m", expr)
            plain = re.sub(r"\$\{?(role|instance)\}?", ".+", plain)
            query(base, plain)  # asserts status "success": a PromQL parse error is a 400
    finally:
        stack.stop()


def test_the_provisioning_files_load_the_dashboard_from_a_prometheus_datasource() -> None:
    grafana = ROOT / "deploy/grafana/provisioning"
    sources = yaml.safe_load((grafana / "datasources/pdserve.yml").read_text())["datasources"]
    assert [s["type"] for s in sources] == ["prometheus"] and sources[0]["isDefault"]
    providers = yaml.safe_load((grafana / "dashboards/pdserve.yml").read_text())["providers"]
    assert providers[0]["type"] == "file" and providers[0]["options"]["path"]

"""``pdserve up --prometheus``: the generated scrape config, and a real Prometheus scraping a
metrics server started the way the services start theirs."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter

from services.common import process
from services.launcher import Stack, free_port
from services.prometheus import scrape_config
from services.up import launch, load_up_config
from tests.prometheus_server import needs_prometheus, query, start_prometheus


def test_the_config_names_each_job_and_its_targets() -> None:
    text = scrape_config({"gateway": ["h:8000"], "decode": ["h:1", "h:2"], "colocated": []})
    config = yaml.safe_load(text)
    assert config["global"]["scrape_interval"] == "5000ms"
    jobs = [(j["job_name"], j["static_configs"][0]["targets"]) for j in config["scrape_configs"]]
    assert jobs == [("gateway", ["h:8000"]), ("decode", ["h:1", "h:2"])]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_generated_config(tmp_path: Path) -> None:
    path = tmp_path / "prometheus.yml"
    path.write_text(scrape_config({"scheduler": ["127.0.0.1:9091"]}, interval_s=0.25))
    done = subprocess.run(["promtool", "check", "config", str(path)], capture_output=True)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_prometheus
def test_a_real_prometheus_scrapes_a_service_metrics_server(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    Counter("pdserve:probe", "test", registry=registry).inc(7)
    port = free_port()
    process.start_metrics(port, "127.0.0.1", registry)
    stack, base = start_prometheus(tmp_path, {"gateway": [f"127.0.0.1:{port}"]})
    try:
        deadline = time.monotonic() + 15  # targets reach the scrapers within 5 s
        while not (got := query(base, 'pdserve:probe_total{job="gateway"}')):
            assert time.monotonic() < deadline, "Prometheus never scraped the target"
            time.sleep(0.2)
        assert float(got[0]["value"][1]) == 7
        assert got[0]["metric"]["instance"] == f"127.0.0.1:{port}"
    finally:
        stack.stop()


def test_a_missing_prometheus_fails_before_anything_starts(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    stack = Stack(log_dir=tmp_path)
    with pytest.raises(RuntimeError, match="needs the prometheus binary on PATH"):
        launch(load_up_config(["--prometheus"], {}), stack)
    assert stack.procs == []

"""A real Prometheus for tests (the ``prometheus`` binary on PATH, as ``pdserve up
--prometheus`` starts it), and its query API."""

from __future__ import annotations

import json
import shutil
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from services.launcher import Stack, free_port
from services.prometheus import READY_LINE, prometheus_proc, scrape_config

needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="the prometheus binary is not installed"
)


def start_prometheus(tmp_path: Path, jobs: dict[str, list[str]]) -> tuple[Stack, str]:
    """Prometheus scraping ``jobs`` every 200 ms; returns its stack (``stop()`` it) and base
    URL. It hands new targets to its scrapers only every 5 s."""
    config = tmp_path / "prometheus.yml"
    config.write_text(scrape_config(jobs, interval_s=0.2))
    address = f"127.0.0.1:{free_port()}"
    stack = Stack(log_dir=tmp_path)
    stack.start(prometheus_proc(config, address, tmp_path), ready_line=READY_LINE)
    stack.wait_ready(stack.procs, timeout=30)
    return stack, f"http://{address}"


def query(base: str, expr: str) -> list[dict]:
    """An instant query's result vector; an HTTPError (400) for an expression that does not
    parse."""
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]

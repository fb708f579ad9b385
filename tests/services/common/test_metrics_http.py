"""The workers' and the scheduler's /metrics server keeps ``pdserve:`` names whatever format
the scraper asks for (prometheus_client's OpenMetrics output would rename the samples)."""

from __future__ import annotations

import urllib.request

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics_http import serve_metrics
from tests.scrape import PROMETHEUS_ACCEPT


def test_samples_keep_their_colon_names_when_openmetrics_is_asked_for() -> None:
    registry = CollectorRegistry()
    Counter("pdserve:things", "d", ["role"], registry=registry).labels("decode").inc(3)
    Histogram("pdserve:wait_seconds", "d", registry=registry, buckets=(1.0,)).observe(0.5)
    server = serve_metrics("127.0.0.1", 0, registry)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        request = urllib.request.Request(url, headers={"Accept": PROMETHEUS_ACCEPT})
        with urllib.request.urlopen(request, timeout=5) as r:
            assert r.headers["Content-Type"].startswith("text/plain;")  # not OpenMetrics
            text = r.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    samples = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert {"pdserve:things_total", "pdserve:wait_seconds_bucket"} <= samples
    assert not any(name.startswith("pdserve_") for name in samples)

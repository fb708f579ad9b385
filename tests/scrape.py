"""Read a Prometheus text endpoint in tests: one series' value, summed over its labels."""

from __future__ import annotations

import re
import urllib.request

# What Prometheus 2.x asks a target for: OpenMetrics first, the classic text format after.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def metric(url: str, name: str, labels: str = "") -> float:
    """The sum of ``name``'s samples at ``url`` whose label set contains ``labels`` (e.g.
    ``'cause="decode_lost"'``); fails the test if no such series is exported."""
    return metric_in(urllib.request.urlopen(url, timeout=5).read().decode(), name, labels, url)


def metric_in(
    text: str, name: str, labels: str = "", where: str = "the scrape", absent: float | None = None
) -> float:
    """``metric`` over an exposition already read (e.g. through ``docker exec``). A labelled
    series appears at its first increment: ``absent`` is its value until then (None: fail)."""
    total, found = 0.0, False
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
        if m and labels in (m.group(1) or ""):
            total += float(m.group(2))
            found = True
    if not found and absent is not None:
        return absent
    assert found, f"{name}{{{labels}}} not exported at {where}"
    return total

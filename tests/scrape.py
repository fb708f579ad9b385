"""Read a Prometheus text endpoint in tests: one series' value, summed over its labels."""

from __future__ import annotations

import re
import urllib.request


def metric(url: str, name: str, labels: str = "") -> float:
    """The sum of ``name``'s samples at ``url`` whose label set contains ``labels`` (e.g.
    ``'cause="decode_lost"'``); fails the test if no such series is exported."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return metric_in(text, name, labels, url)


def metric_in(text: str, name: str, labels: str = "", where: str = "the text") -> float:
    """``metric`` of an exposition already read (``where``: its source, for the failure)."""
    total, found = 0.0, False
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
        if m and labels in (m.group(1) or ""):
            total += float(m.group(2))
            found = True
    assert found, f"{name}{{{labels}}} not exported at {where}"
    return total

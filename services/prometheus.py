"""``pdserve up --prometheus``: a Prometheus server scraping the local stack.

The stack's metrics ports are chosen when it starts, so the scrape config is written then,
from the ports actually given out, into the log directory. Jobs are named as in
``deploy/prometheus/prometheus.yml`` (the compose stack's), so one dashboard reads both.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

from services.launcher import Proc

READY_LINE = "Server is ready to receive web requests."


def scrape_config(jobs: Mapping[str, Sequence[str]], interval_s: float = 5.0) -> str:
    """Prometheus's configuration scraping ``jobs`` (job name -> ``host:port`` targets at
    ``/metrics``). JSON, which is YAML too, so no YAML library is needed at run time."""
    interval = f"{round(interval_s * 1000)}ms"  # Prometheus durations are whole numbers
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": list(targets)}]}
            for job, targets in jobs.items()
            if targets
        ],
    }
    return json.dumps(config, indent=2) + "\n"


def prometheus_exe() -> str:
    """The ``prometheus`` binary on PATH; ``RuntimeError`` when it is not installed."""
    exe = shutil.which("prometheus")
    if exe is None:
        raise RuntimeError(
            "--prometheus needs the prometheus binary on PATH (Debian/Ubuntu: apt-get install "
            "prometheus; or a release from prometheus.io/download)"
        )
    return exe


def prometheus_proc(config: Path, address: str, workdir: Path) -> Proc:
    """Prometheus serving ``address`` (host:port) with ``config``, its data in
    ``workdir/prometheus``; start it with ``ready_line=READY_LINE``."""
    data = workdir / "prometheus"
    data.mkdir(parents=True, exist_ok=True)
    argv = [prometheus_exe(), f"--config.file={config}", f"--storage.tsdb.path={data}",
            f"--web.listen-address={address}"]  # fmt: skip
    return Proc("prometheus", argv)

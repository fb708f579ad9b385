"""What the chaos run reads from the stack: worker and gateway metrics, the gateway's log of
migrations, and the KV segments in ``/dev/shm``. Parsing is pure; the readers do I/O."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import aiohttp

from services.gateway.cluster_backend import client_request_id

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "pdserve-kv-"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric ``name`` in a Prometheus text exposition, with its labels.

    >>> samples('a_total{cause="x"} 2.0\\na_total{cause="y"} 1.0\\n', "a_total")
    [({'cause': 'x'}, 2.0), ({'cause': 'y'}, 1.0)]
    """
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name:
            out.append((dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


async def scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
        r.raise_for_status()
        return await r.text()


async def free_blocks(
    session: aiohttp.ClientSession, endpoints: Mapping[str, str]
) -> dict[str, int | None]:
    """Each worker's ``pdserve:kv_free_blocks`` (None: its metrics did not answer)."""
    out: dict[str, int | None] = {}
    for key, url in endpoints.items():
        if not key.startswith("metrics:"):
            continue
        try:
            found = samples(await scrape(session, url), "pdserve:kv_free_blocks")
        except (aiohttp.ClientError, OSError, TimeoutError):
            found = []
        out[key.split(":", 1)[1]] = int(sum(v for _, v in found)) if found else None
    return out


KV_STORE_COUNTERS = ("hit_blocks", "stored_blocks", "refused_blocks", "missing_blocks",
                     "dropped_blocks", "failed_puts")  # fmt: skip


async def kv_store_counters(
    session: aiohttp.ClientSession, endpoints: Mapping[str, str]
) -> dict[str, float]:
    """The workers' ``pdserve:kv_store_<name>_total``, summed (a restarted worker's count
    starts again at 0, so these are at least what happened); a worker whose metrics do not
    answer adds nothing."""
    out = dict.fromkeys(KV_STORE_COUNTERS, 0.0)
    for key, url in endpoints.items():
        if not key.startswith("metrics:"):
            continue
        try:
            text = await scrape(session, url)
        except (aiohttp.ClientError, OSError, TimeoutError):
            continue
        for name in KV_STORE_COUNTERS:
            out[name] += sum(v for _, v in samples(text, f"pdserve:kv_store_{name}_total"))
    return out


async def migrations(session: aiohttp.ClientSession, metrics_url: str) -> dict[str, float]:
    """The gateway's ``pdserve:migrations_total`` by cause."""
    text = await scrape(session, metrics_url)
    return {labels.get("cause", ""): v for labels, v in samples(text, "pdserve:migrations_total")}


def migrated_requests(log_path: Path) -> dict[str, list[str]]:
    """request id (the client's) -> the causes of its ``request_migrating`` lines in a
    gateway log (which names requests by their ids inside the cluster)."""
    out: dict[str, list[str]] = {}
    if not log_path.exists():
        return out
    for line in log_path.read_text(errors="replace").splitlines():
        if "request_migrating" not in line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("event") == "request_migrating":
            rid = client_request_id(str(rec.get("request_id")))
            out.setdefault(rid, []).append(str(rec.get("cause")))
    return out


def kv_segments(shm_dir: str = SHM_DIR) -> dict[str, int]:
    """Every ``pdserve-kv-*`` segment in ``shm_dir`` and its size in bytes."""
    out = {}
    for name in sorted(os.listdir(shm_dir)):
        if name.startswith(SEGMENT_PREFIX):
            try:
                out[name] = os.stat(os.path.join(shm_dir, name)).st_size
            except FileNotFoundError:
                continue
    return out

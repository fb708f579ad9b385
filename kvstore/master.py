"""How a deployment starts its store's ``mooncake_master`` (``pdserve up``, the tests, and
compose's command line say the same thing through ``master_argv``).

The master holds only metadata (which object lives in which process's segment); the bytes
live in the engine processes' mounted DRAM and their SSD tiers. It keeps nothing on disk:
a restarted master starts empty, and the stores re-mount their segments to it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

READY_LINE = "Master service started on port"

# A lease protects an object from eviction while a reader copies it; loads take
# milliseconds, so a short one lets a full pool evict soon after a read.
LEASE_TTL_MS = 1000
# Seconds without a heartbeat after which the master drops a client's segment (and the
# objects in it): how long a dead worker's blocks still look present (loads then fail
# and fall back to computing).
CLIENT_TTL_S = 10


def master_executable() -> str:
    """The ``mooncake_master`` binary: the one Mooncake's wheel ships, else on PATH."""
    try:
        import mooncake
    except ImportError:
        mooncake = None  # type: ignore[assignment]
    if mooncake is not None:
        shipped = Path(mooncake.__file__).parent / "mooncake_master"
        if shipped.is_file():
            return str(shipped)
    found = shutil.which("mooncake_master")
    if found is None:
        raise RuntimeError(
            "mooncake_master is not installed (bash scripts/setup.sh installs Mooncake; or "
            "pip install mooncake-transfer-engine-non-cuda)"
        )
    return found


def master_argv(
    port: int, *, metrics_port: int, host: str = "0.0.0.0", ssd: bool = False
) -> list[str]:
    """``mooncake_master`` serving its RPC on ``host:port`` and Prometheus metrics on
    ``metrics_port``; ``ssd``: clients may keep an SSD tier (``--kv-store-ssd-dir``)."""
    return [
        master_executable(),
        f"--rpc_port={port}",
        f"--rpc_address={host}",
        f"--metrics_port={metrics_port}",
        f"--default_kv_lease_ttl={LEASE_TTL_MS}",
        f"--client_ttl={CLIENT_TTL_S}",
        f"--enable_offload={'true' if ssd else 'false'}",
    ]

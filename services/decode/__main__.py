"""``python -m services.decode``: a decode worker (``--role colocated``: prefills too).

Its KV pool is registered once with the chosen transport (``shm``: a POSIX shared-memory
segment prefill workers on this host copy into, after removing segments whose owner died;
``tcp``: a receiver other hosts write to; ``mooncake``: memory registered with Mooncake's
Transfer Engine, which other hosts write into over RDMA or TCP). For each request it
reserves blocks, has the prefill worker named in the request fill them, then streams tokens
from its continuous batch. Its settings: ``services.decode.config``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import structlog

from services.common import process
from services.decode.config import DecodeConfig, load_config

log = structlog.get_logger(__name__)

if TYPE_CHECKING:
    import torch

    from engine.kv_cache import KVCacheSpec
    from transfer.base import KVRegion


async def _main(cfg: DecodeConfig) -> None:
    # Imported after the flags are read: they pull in torch, and --help stays fast.
    from pdserve.v1 import worker_pb2_grpc
    from services.common import cluster_auth
    from services.common.kv_store import StoreLink
    from services.common.worker import build_engine, serve_worker, worker_id
    from services.decode.server import DecodeServicer
    from transfer.handle import KVLayout
    from transfer.registry import get_transport
    from transfer.shm import sweep_stale_segments

    region: KVRegion | None = None
    transport = None
    kv_memory = None
    if cfg.role == "decode":
        opts: dict[str, object] = {}
        if cfg.transport == "tcp":
            opts = {
                "host": cfg.worker.host,
                "port": cfg.kv_port,
                "advertise_host": cfg.worker.advertise_host,
            }
        elif cfg.transport == "mooncake":
            opts = cfg.mooncake.options(cfg.worker.reachable_host)
        elif cfg.transport == "cuda_ipc" and cfg.engine.device.startswith("cuda"):
            opts = {"device": cfg.engine.device}  # the pool lives on the engine's GPU
        transport = get_transport(cfg.transport, **opts)
        if cfg.transport == "shm":
            # Segments whose owner died without removing them (SIGKILL, a crash): their
            # memory stays allocated in tmpfs until someone unlinks them.
            for path in sweep_stale_segments():
                log.info("stale_kv_segment_removed", path=path)

        def kv_memory(spec: KVCacheSpec) -> torch.Tensor:
            nonlocal region
            region = transport.register(KVLayout.from_spec(spec))
            return region.tensor

    aengine = build_engine(cfg.engine, cfg.tuning, cfg.role, kv_memory)
    server = process.GrpcServer(
        ["pdserve.v1.DecodeWorker"], cfg.worker.host, cfg.worker.port,
        advertise_host=cfg.worker.advertise_host, auth=cluster_auth.installed(),
    )  # fmt: skip
    handle = region.handle if region is not None else None
    store = StoreLink(cfg.store, aengine, cfg.worker.reachable_host, cfg.role)
    servicer = DecodeServicer(
        aengine,
        handle,
        role=cfg.role,
        worker_id=worker_id(cfg.worker, cfg.role, server),
        prefill_deadline_s=cfg.prefill_deadline_s,
        store=store,
    )
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server.server)
    names = [cfg.transport] if cfg.role == "decode" else []
    try:
        await serve_worker(
            cfg.worker, cfg.role, server, aengine, names, lambda: servicer.inflight, handle,
            data_plane_healthy=lambda: transport is None or transport.healthy, store=store,
        )  # fmt: skip
    finally:
        await servicer.close()
        if transport is not None:
            transport.close()


def main(argv: Sequence[str] | None = None) -> int:
    cfg = load_config(argv)
    return process.run(
        cfg.role, cfg.worker.log_level, _main(cfg), cfg.tuning, cfg.cluster, cfg.fault_args
    )


if __name__ == "__main__":
    sys.exit(main())

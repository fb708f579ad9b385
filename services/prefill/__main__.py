"""``python -m services.prefill``: a prefill worker.

It computes prompts, writes their KV into decode workers' registered memory layer by layer
(``shm`` on one host, ``tcp`` or ``mooncake`` anywhere), and answers each ``Prefill`` with
the first token.
Its settings: ``services.prefill.config``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from services.common import process
from services.prefill.config import PrefillConfig, load_config


async def _main(cfg: PrefillConfig) -> None:
    # Imported after the flags are read: they pull in torch, and --help stays fast.
    from pdserve.v1 import worker_pb2_grpc
    from services.common import cluster_auth
    from services.common.kv_store import StoreLink
    from services.common.placement_token import VerifyKeys
    from services.common.worker import build_engine, serve_worker, worker_id
    from services.prefill.server import PrefillServicer
    from transfer.registry import get_transport

    aengine = build_engine(
        cfg.engine, cfg.tuning, "prefill", prefill_token_budget=cfg.prefill_token_budget
    )
    transports = {n: get_transport(n, **cfg.transport_options(n)) for n in cfg.transports}
    faults = cfg.fault_args.spec  # none unless --faults / PDSERVE_FAULTS says
    for t in transports.values():
        t.inject_faults(faults)
    server = process.GrpcServer(
        ["pdserve.v1.PrefillWorker"], cfg.worker.host, cfg.worker.port,
        advertise_host=cfg.worker.advertise_host, auth=cluster_auth.installed(),
    )  # fmt: skip
    store = StoreLink(cfg.store, aengine, cfg.worker.reachable_host, "prefill")
    # The scheduler's public keys, as this worker registers (--insecure-cluster: unchecked).
    verify_keys = VerifyKeys() if cluster_auth.installed().token is not None else None
    servicer = PrefillServicer(
        aengine, transports, worker_id=worker_id(cfg.worker, "prefill", server),
        verify_keys=verify_keys, store=store,
    )  # fmt: skip
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server.server)
    try:
        await serve_worker(
            cfg.worker, "prefill", server, aengine, list(cfg.transports),
            lambda: servicer.inflight, store=store, verify_keys=verify_keys,
        )  # fmt: skip
    finally:
        for t in transports.values():
            t.close()


def main(argv: Sequence[str] | None = None) -> int:
    cfg = load_config(argv)
    return process.run(
        "prefill", cfg.worker.log_level, _main(cfg), cfg.tuning, cfg.cluster, cfg.fault_args
    )


if __name__ == "__main__":
    sys.exit(main())

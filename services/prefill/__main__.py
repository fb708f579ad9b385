"""``python -m services.prefill``: a prefill worker.

It computes prompts, writes their KV into decode workers' registered memory layer by layer
(``shm`` on one host, ``tcp`` anywhere), and answers each ``Prefill`` with the first token.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from engine.async_engine import AsyncEngine
from pdserve.v1 import worker_pb2_grpc
from services.common.config import add_service_flags, apply_env_defaults, tcp_congestion
from services.common.engine_args import add_engine_flags, add_worker_flags
from services.common.serving import GrpcService, configure_logging, install_uvloop
from services.common.worker import build_engine, serve_worker
from services.prefill.server import PrefillServicer
from transfer.registry import get_transport


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.prefill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_service_flags(p, port=50061, metrics_port=0)
    p.add_argument("--transports", default="shm,tcp",
                   help="comma-separated transports this worker can write with")  # fmt: skip
    p.add_argument("--kv-tcp-congestion", type=tcp_congestion, default=None, metavar="NAME",
                   help="TCP congestion control of this worker's tcp KV connections (e.g. "
                   "reno; default: the system's). On one host reno avoids BBR's pacing "
                   "reordering loopback segments")  # fmt: skip
    p.add_argument("--prefill-token-budget", type=int, default=4096,
                   help="most prompt tokens computed in one forward pass")  # fmt: skip
    add_engine_flags(p)
    add_worker_flags(p)
    apply_env_defaults(p, "prefill")
    return p


def transport_options(args: argparse.Namespace, name: str) -> dict[str, object]:
    """The options this worker's flags give transport ``name``."""
    if name == "tcp" and args.kv_tcp_congestion:
        return {"congestion": args.kv_tcp_congestion}
    return {}


async def _main(args: argparse.Namespace) -> None:
    engine = build_engine(args)
    aengine = AsyncEngine(
        engine, prefill_token_budget=args.prefill_token_budget, cpus=args.engine_cpus
    )
    names = [t.strip() for t in args.transports.split(",") if t.strip()]
    transports = {n: get_transport(n, **transport_options(args, n)) for n in names}
    svc = GrpcService("pdserve.v1.PrefillWorker", args.host, args.port, args.advertise_host)
    servicer = PrefillServicer(aengine, transports)
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, svc.server)
    try:
        await serve_worker(args, "prefill", svc, aengine, names, lambda: servicer.inflight)
    finally:
        for t in transports.values():
            t.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging("prefill", args.log_level)
    install_uvloop()
    asyncio.run(_main(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

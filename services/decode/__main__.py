"""``python -m services.decode``: a decode worker (``--role colocated``: prefills too).

Its KV pool is registered once with the chosen transport (``shm``: a POSIX shared-memory
segment prefill workers on this host copy into; ``tcp``: a receiver other hosts write
to). For each request it reserves blocks, has the prefill worker named in the request
fill them, then streams tokens from its continuous batch.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

import torch

from engine.async_engine import AsyncEngine
from engine.kv_cache import KVCacheSpec
from pdserve.v1 import worker_pb2_grpc
from services.common.config import add_service_flags, apply_env_defaults
from services.common.engine_args import add_engine_flags, add_worker_flags
from services.common.serving import GrpcService, configure_logging, install_uvloop
from services.common.worker import build_engine, serve_worker
from services.decode.server import DecodeServicer
from transfer.base import KVRegion
from transfer.handle import KVLayout
from transfer.registry import get_transport


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_service_flags(p, port=50071, metrics_port=0)
    p.add_argument("--role", choices=["decode", "colocated"], default="decode")
    p.add_argument("--transport", choices=["shm", "tcp"], default="shm",
                   help="how prefill workers write into this worker's KV pool")  # fmt: skip
    p.add_argument("--kv-port", type=int, default=0,
                   help="tcp transport: port of the KV receiver (0: any free port)")  # fmt: skip
    p.add_argument("--local-prefill-max-tokens", type=int, default=0, metavar="TOKENS",
                   help="prefill prompts up to this long here even when a prefill worker is "
                   "named (conditional disaggregation; 0: never)")  # fmt: skip
    p.add_argument("--prefill-deadline", type=float, default=30.0, metavar="SECONDS")
    add_engine_flags(p)
    add_worker_flags(p)
    apply_env_defaults(p, "decode")
    return p


async def _main(args: argparse.Namespace) -> None:
    region: KVRegion | None = None
    transport = None
    if args.role == "decode":
        opts: dict[str, object] = {}
        if args.transport == "tcp":
            opts = {"host": args.host, "port": args.kv_port, "advertise_host": args.advertise_host}
        transport = get_transport(args.transport, **opts)

        def kv_memory(spec: KVCacheSpec) -> torch.Tensor:
            nonlocal region
            region = transport.register(KVLayout.from_spec(spec))
            return region.tensor

        engine = build_engine(args, kv_memory)
    else:
        engine = build_engine(args)
    aengine = AsyncEngine(engine, cpus=args.engine_cpus)
    svc = GrpcService("pdserve.v1.DecodeWorker", args.host, args.port, args.advertise_host)
    servicer = DecodeServicer(
        aengine,
        region.handle if region is not None else None,
        role=args.role,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        prefill_deadline_s=args.prefill_deadline,
    )
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, svc.server)
    names = [args.transport] if args.role == "decode" else []
    try:
        await serve_worker(args, args.role, svc, aengine, names, lambda: servicer.inflight)
    finally:
        await servicer.close()
        if transport is not None:
            transport.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.role, args.log_level)
    install_uvloop()
    asyncio.run(_main(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The process shell of an engine worker (prefill, decode or colocated).

receive (gRPC servicer) -> schedule/execute (AsyncEngine thread) -> postprocess (servicer);
plus registration and heartbeats to the scheduler, metrics, and the SIGTERM drain.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable

import structlog
import torch

from engine.async_engine import AsyncEngine
from engine.kv_cache import KVCacheSpec
from engine.llm_engine import LLMEngine
from pdserve.v1 import common_pb2, scheduler_pb2
from services.common import metrics
from services.common.engine_args import engine_config
from services.common.registration import Registrar
from services.common.serving import GrpcService, host_id, start_metrics

log = structlog.get_logger(__name__)

_ROLES = {
    "prefill": common_pb2.WORKER_ROLE_PREFILL,
    "decode": common_pb2.WORKER_ROLE_DECODE,
    "colocated": common_pb2.WORKER_ROLE_COLOCATED,
}


def build_engine(
    args: argparse.Namespace, kv_memory: Callable[[KVCacheSpec], torch.Tensor] | None = None
) -> LLMEngine:
    t0 = time.monotonic()
    engine = LLMEngine(engine_config(args), kv_memory=kv_memory)
    log.info("engine_ready", seconds=round(time.monotonic() - t0, 2),
             kv_blocks=engine.blocks.num_blocks, max_model_len=engine.max_model_len)  # fmt: skip
    return engine


def worker_info(
    args: argparse.Namespace, role: str, svc: GrpcService, engine: LLMEngine, transports: list[str]
) -> common_pb2.WorkerInfo:
    metrics_addr = (
        f"{svc.address.rsplit(':', 1)[0]}:{args.metrics_port}" if args.metrics_port else ""
    )
    return common_pb2.WorkerInfo(
        worker_id=args.worker_id or f"{role}-{host_id()}-{svc.port}",
        role=_ROLES[role],
        grpc_address=svc.address,
        metrics_address=metrics_addr,
        transports=transports,
        model=engine.model_config.name,
        capacity=common_pb2.WorkerCapacity(
            total_kv_blocks=engine.blocks.num_blocks,
            block_size=engine.kv_spec.block_size,
            max_num_seqs=engine.config.max_num_seqs,
            max_model_len=engine.max_model_len,
            max_num_batched_tokens=engine.scheduler.config.max_num_batched_tokens,
        ),
        host_id=host_id(),
        started_unix_ns=time.time_ns(),
    )


def load_snapshot(aengine: AsyncEngine, role: str) -> scheduler_pb2.LoadSnapshot:
    st = aengine.stats
    metrics.RUNNING.labels(role).set(st.running + st.held)
    metrics.WAITING.labels(role).set(st.waiting)
    metrics.KV_USAGE.labels(role).set(st.kv_usage)
    return scheduler_pb2.LoadSnapshot(
        running_requests=st.running + st.held,
        waiting_requests=st.waiting,
        free_kv_blocks=st.free_blocks,
        total_kv_blocks=st.total_blocks,
        queued_prompt_tokens=st.queued_prefill_tokens,
    )


def apply_switch_interval(args: argparse.Namespace) -> float:
    """Set this process's thread switch interval from ``--switch-interval-ms``.

    A worker has two busy threads: the engine thread (Python between torch ops) and the
    event loop that streams tokens over gRPC. When one wants the GIL the other holds, it
    waits up to the switch interval, so Python's 5 ms default lands directly on the P99 of
    every token's delivery. Returns the interval set, in seconds.
    """
    interval = args.switch_interval_ms / 1000.0
    sys.setswitchinterval(interval)
    return sys.getswitchinterval()


def step_observer(role: str) -> Callable[[str, float, int], None]:
    """An ``AsyncEngine.on_step`` hook feeding ``pdserve:engine_step_seconds``."""
    series = {kind: metrics.ENGINE_STEP_SECONDS.labels(role, kind) for kind in ("step", "prefill")}

    def observe(kind: str, seconds: float, size: int) -> None:
        series[kind].observe(seconds)

    return observe


async def serve_worker(
    args: argparse.Namespace,
    role: str,
    svc: GrpcService,
    aengine: AsyncEngine,
    transports: list[str],
    inflight: Callable[[], int],
) -> None:
    """Run until SIGTERM; then stop taking work and wait for in-flight requests."""
    apply_switch_interval(args)
    start_metrics(args.metrics_port, args.host)
    aengine.on_step = step_observer(role)
    metrics.DELIVERY_WAIT_TIMEOUTS.labels(role)  # exported at 0 from the start
    aengine.start()

    async def publish_gauges() -> None:
        waits = 0
        while True:
            load_snapshot(aengine, role)
            now = aengine.num_delivery_waits
            if now > waits:
                metrics.DELIVERY_WAIT_TIMEOUTS.labels(role).inc(now - waits)
                waits = now
            await asyncio.sleep(0.1)

    background = [publish_gauges()]
    registrar = None
    if args.scheduler:
        info = worker_info(args, role, svc, aengine.engine, transports)
        registrar = Registrar(
            args.scheduler, info, lambda: load_snapshot(aengine, role),
            interval_s=args.heartbeat_interval,
        )  # fmt: skip
        background.append(registrar.run())

    async def drain() -> None:
        if registrar is not None:
            registrar.draining = True
            await registrar.deregister()
        while inflight() > 0:
            await asyncio.sleep(0.05)

    # the address printed here is what `pdserve up` and tests wait for
    print(f"READY {role} {svc.address}", flush=True)
    await svc.run(grace=args.drain_timeout, on_drain=drain, background=background)
    await aengine.stop()

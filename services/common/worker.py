"""The part of the process shell only engine workers (prefill, decode, colocated) have.

receive (gRPC servicer) -> schedule/execute (AsyncEngine thread) -> postprocess (servicer);
plus the step-time calibration of a decode or colocated engine before READY (its batch
target under the ITL target: ``engine/step_budget.py``), registration and heartbeats to the
scheduler (the load, the batch target with it), metrics, and the drain of in-flight
requests (the rest of the shell is ``services.common.process``).
"""

from __future__ import annotations

import asyncio
import functools
import socket
import time
from collections.abc import Callable
from typing import Any

import structlog
import torch

from engine.async_engine import AsyncEngine, EngineStats
from engine.engine_config import EngineConfig
from engine.kv_cache import KVCacheSpec
from engine.llm_engine import LLMEngine
from kernels.paged_attention import cpu_kernel_available
from pdserve.v1 import common_pb2, scheduler_pb2
from services.common import metrics, process
from services.common.kv_store import StoreLink
from services.common.placement_token import VerifyKeys, region_digest
from services.common.registration import Registrar
from services.common.tuning import Tuning
from services.common.worker_args import WorkerArgs
from transfer.handle import MemoryRegionHandle

log = structlog.get_logger(__name__)

_ROLES = {
    "prefill": common_pb2.WORKER_ROLE_PREFILL,
    "decode": common_pb2.WORKER_ROLE_DECODE,
    "colocated": common_pb2.WORKER_ROLE_COLOCATED,
}


def host_id() -> str:
    """Identifies the machine: shm transfer only works between workers with equal host ids."""
    return socket.gethostname()


def build_engine(
    args: EngineConfig,
    tuning: Tuning,
    role: str,
    kv_memory: Callable[[KVCacheSpec], torch.Tensor] | None = None,
    **options: Any,
) -> AsyncEngine:
    """The ``role`` worker's engine, driven by its own thread laid out by ``tuning`` (not
    started yet); ``options``: further ``AsyncEngine`` arguments."""
    t0 = time.monotonic()
    config = args.resolved(role, tuning.engine_cpus)
    if role == "prefill" and kv_memory is None:
        # The pool the transfer reads: the engine's own on the CPU, else a host pool its
        # layers are staged into (engine/kv_staging.py), page-locked for a GPU's copies.
        pinned = config.device.startswith("cuda")
        kv_memory = functools.partial(host_pool_memory, pinned=pinned)
    engine = LLMEngine(config, kv_memory=kv_memory)
    if config.cpu_kernels:
        # Loaded (compiled, on a machine's first run) now, before READY: not by the first
        # decode step, which would stall every stream placed here meanwhile.
        cpu_kernel_available()
    log.info("engine_ready", seconds=round(time.monotonic() - t0, 2), role=role,
             device=config.device, dtype=config.dtype, kv_staged=engine.staging is not None,
             weights=engine.weight_format, kv_dtype=config.kv_cache_dtype,
             weight_mib=_mib(engine.model.weight_bytes),
             kv_mib=_mib(engine.kv_spec.total_bytes), kv_blocks=engine.blocks.num_blocks,
             max_model_len=engine.max_model_len)  # fmt: skip
    return AsyncEngine(engine, **tuning.engine_options(), **options)


def host_pool_memory(spec: KVCacheSpec, *, pinned: bool = True) -> torch.Tensor:
    """Zeroed host memory for a KV pool; ``pinned``: page-locked (needs CUDA), so a GPU
    engine's copies of staged layers run asynchronously at full speed."""
    return torch.zeros(spec.total_bytes, dtype=torch.uint8, pin_memory=pinned)


def _mib(n: int) -> float:
    return round(n / (1 << 20), 1)


def memory_report(engine: LLMEngine) -> dict[str, str]:
    """The weight format and memory a worker's READY line states (``pdserve up`` prints
    it): what the engine holds, not what was asked."""
    return {
        "weights": engine.weight_format,
        "weight_mib": f"{_mib(engine.model.weight_bytes)}",
        "kv_mib": f"{_mib(engine.kv_spec.total_bytes)}",
        "kv_dtype": str(engine.kv_spec.dtype).removeprefix("torch."),
    }


def worker_id(args: WorkerArgs, role: str, server: process.GrpcServer) -> str:
    """The id this worker registers under."""
    return args.worker_id or f"{role}-{host_id()}-{server.port}"


def worker_info(
    args: WorkerArgs,
    role: str,
    server: process.GrpcServer,
    engine: LLMEngine,
    transports: list[str],
    kv_region: MemoryRegionHandle | None = None,
    kv_store: str = "",
) -> common_pb2.WorkerInfo:
    """``kv_region``: the region prefill workers write into (decode workers); its digest is
    what placement tokens name. ``kv_store``: the KV store's master it loads from."""
    host = server.address.rsplit(":", 1)[0]
    digest = ""
    if kv_region is not None:
        digest = region_digest(kv_region.transport, kv_region.address, kv_region.region_id)
    return common_pb2.WorkerInfo(
        worker_id=worker_id(args, role, server),
        kv_region_digest=digest,
        role=_ROLES[role],
        grpc_address=server.address,
        metrics_address=f"{host}:{args.metrics_port}" if args.metrics_port else "",
        transports=transports,
        model=engine.model_config.name,
        capacity=common_pb2.WorkerCapacity(
            total_kv_blocks=engine.blocks.num_blocks,
            block_size=engine.kv_spec.block_size,
            max_num_seqs=engine.config.max_num_seqs,
            max_model_len=engine.max_model_len,
            max_num_batched_tokens=engine.scheduler.limits.max_num_batched_tokens,
        ),
        host_id=host_id(),
        started_unix_ns=time.time_ns(),
        kv_store=kv_store,
    )


def load_snapshot(st: EngineStats, role: str) -> scheduler_pb2.LoadSnapshot:
    """The heartbeat's load report; sets the load gauges to the same numbers."""
    metrics.RUNNING.labels(role).set(st.running + st.held)
    metrics.WAITING.labels(role).set(st.waiting)
    metrics.PROMPT_TOKENS_WAITING.labels(role).set(st.queued_prefill_tokens)
    metrics.KV_USAGE.labels(role).set(st.kv_usage)
    metrics.KV_FREE.labels(role).set(st.free_blocks)
    metrics.TARGET_BATCH.labels(role).set(st.target_batch)
    on_worker = st.running + st.held + st.waiting
    metrics.BATCH_TARGET_USAGE.labels(role).set(on_worker / max(1, st.target_batch))
    metrics.ITL_TARGET.labels(role).set(st.itl_target_s)
    return scheduler_pb2.LoadSnapshot(
        running_requests=st.running + st.held,
        waiting_requests=st.waiting,
        free_kv_blocks=st.free_blocks,
        total_kv_blocks=st.total_blocks,
        queued_prompt_tokens=st.queued_prefill_tokens,
        target_batch=st.target_batch,
    )


def step_observer(role: str) -> Callable[[str, float, int], None]:
    """An ``AsyncEngine.on_step`` hook feeding ``pdserve:engine_step_seconds`` and
    ``pdserve:engine_step_batch_size``."""
    series = {kind: metrics.ENGINE_STEP_SECONDS.labels(role, kind) for kind in ("step", "prefill")}
    batch = metrics.STEP_BATCH.labels(role)

    def observe(kind: str, seconds: float, size: int) -> None:
        series[kind].observe(seconds)
        if kind == "step":
            batch.observe(size)

    return observe


async def watch_data_plane(
    healthy: Callable[[], bool],
    server: process.GrpcServer,
    registrar: Registrar | None,
    *,
    every_s: float = 1.0,
) -> None:
    """Once ``healthy()`` turns False (peers can no longer write this worker's KV), report
    NOT_SERVING on the health service and DRAINING to the scheduler, for good."""
    while healthy():
        await asyncio.sleep(every_s)
    log.error("kv_data_plane_down")
    await server.set_serving(False)
    if registrar is not None:
        registrar.draining = True


async def serve_worker(
    args: WorkerArgs,
    role: str,
    server: process.GrpcServer,
    aengine: AsyncEngine,
    transports: list[str],
    inflight: Callable[[], int],
    kv_region: MemoryRegionHandle | None = None,
    data_plane_healthy: Callable[[], bool] = lambda: True,
    store: StoreLink | None = None,
    verify_keys: VerifyKeys | None = None,
) -> None:
    """Run until SIGTERM; then stop taking work and wait for in-flight requests.
    ``store``: connected in the background once the engine runs, closed on the way out.
    ``verify_keys``: filled with the scheduler's placement public key as it registers.
    ``data_plane_healthy``: False once peers can no longer write this worker's KV (its
    receiver died): the worker then reports NOT_SERVING, and DRAINING to the scheduler."""
    process.start_metrics(args.metrics_port, args.host)
    aengine.on_step = step_observer(role)
    metrics.DELIVERY_WAIT_TIMEOUTS.labels(role)  # exported at 0 from the start
    aengine.start()
    if role != "prefill":
        # Before READY: the first placement sees the batch target and the ITL target.
        await aengine.calibrate()

    async def publish_gauges() -> None:
        waits = 0
        while True:
            load_snapshot(aengine.stats, role)
            now = aengine.num_delivery_waits
            if now > waits:
                metrics.DELIVERY_WAIT_TIMEOUTS.labels(role).inc(now - waits)
                waits = now
            await asyncio.sleep(0.1)

    background = [publish_gauges()]
    registrar = None
    if args.scheduler:
        master = store.master if store is not None else ""
        info = worker_info(args, role, server, aengine.engine, transports, kv_region, master)
        registrar = Registrar(
            args.scheduler, info, lambda: load_snapshot(aengine.stats, role),
            interval_s=args.heartbeat_interval_s, cache=aengine.engine.cache_events,
            store=store, verify_keys=verify_keys,
        )  # fmt: skip
        background.append(registrar.run())

    background.append(watch_data_plane(data_plane_healthy, server, registrar))
    if store is not None:
        background.append(store.run())

    async def drain() -> None:
        if registrar is not None:
            registrar.draining = True
            await registrar.deregister()
        while inflight() > 0:
            await asyncio.sleep(0.05)

    try:
        await process.serve(
            server,
            role=role,
            drain_timeout_s=args.drain_timeout_s,
            on_drain=drain,
            background=background,
            ready=memory_report(aengine.engine),
        )
    finally:
        if store is not None:
            await store.close()
        await aengine.stop()

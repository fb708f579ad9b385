"""The scheduler's gRPC edge: the only module that sees protobuf.

``SchedulerServicer`` converts ``pdserve.v1`` messages into ``model`` dataclasses, hands
them to ``SchedulerState`` and maps results and errors to gRPC statuses:

=========================  ===================================================
Rejection / error          status
=========================  ===================================================
UNKNOWN_MODEL              NOT_FOUND
NO_LIVE_WORKER             UNAVAILABLE
NEVER_FITS                 INVALID_ARGUMENT
CAPACITY, INFLIGHT_CAP     RESOURCE_EXHAUSTED (+ trailing "retry-after-ms")
SchedulerOverloaded        RESOURCE_EXHAUSTED (+ trailing "retry-after-ms")
SchedulerClosed, draining  UNAVAILABLE
UnknownWorker              NOT_FOUND
bad message                INVALID_ARGUMENT
=========================  ===================================================

``SchedulerServer`` assembles the process: Redis store, state loop, the gRPC server (the
shell's ``GrpcServer``, served by ``services.common.process.serve``) and the Prometheus
/metrics endpoint; ``start()`` restores the registry from Redis before the server reports
SERVING (a cold start if Redis does not answer), ``drain()`` refuses new work, ``close()``
flushes and closes once it stopped. While it runs, ``redis_link.watch`` probes Redis and
has the state loop write everything again after Redis restarted or came back; placement
goes on from memory throughout.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import NoReturn

import grpc
import redis.asyncio as aioredis
import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pdserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common import cluster_auth, placement_token, process
from services.common.settings import read_secret
from services.scheduler import redis_link
from services.scheduler.config import SchedulerConfig
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.model import (
    FinishReason,
    HeartbeatReport,
    Outcome,
    Placement,
    PlaceRequest,
    Rejection,
    RejectReason,
    Role,
    WorkerCapacity,
    WorkerInfo,
    WorkerLoad,
    WorkerState,
)
from services.scheduler.state import (
    SchedulerClosed,
    SchedulerOverloaded,
    SchedulerState,
    UnknownWorker,
)
from services.scheduler.store import KeySpace, RecordSink, RedisStore, StoredWorker

log = structlog.get_logger(__name__)

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
RETRY_AFTER_KEY = "retry-after-ms"

_ROLE_FROM_PB = {
    common_pb2.WORKER_ROLE_PREFILL: Role.PREFILL,
    common_pb2.WORKER_ROLE_DECODE: Role.DECODE,
    common_pb2.WORKER_ROLE_COLOCATED: Role.COLOCATED,
}
_ROLE_TO_PB = {role: pb for pb, role in _ROLE_FROM_PB.items()}
_STATE_FROM_PB = {
    scheduler_pb2.WORKER_STATE_SERVING: WorkerState.SERVING,
    scheduler_pb2.WORKER_STATE_DRAINING: WorkerState.DRAINING,
}
_FINISH_FROM_PB = {
    common_pb2.FINISH_REASON_STOP: FinishReason.STOP,
    common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    common_pb2.FINISH_REASON_ABORT: FinishReason.ABORT,
    common_pb2.FINISH_REASON_ERROR: FinishReason.ERROR,
}
_REJECT_STATUS = {
    RejectReason.UNKNOWN_MODEL: grpc.StatusCode.NOT_FOUND,
    RejectReason.NO_LIVE_WORKER: grpc.StatusCode.UNAVAILABLE,
    RejectReason.NEVER_FITS: grpc.StatusCode.INVALID_ARGUMENT,
    RejectReason.CAPACITY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RejectReason.INFLIGHT_CAP: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RejectReason.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class InvalidMessage(ValueError):
    """A request message breaks its documented contract (INVALID_ARGUMENT)."""


# ---- protobuf <-> model ----


def worker_info_from_pb(pb: common_pb2.WorkerInfo) -> WorkerInfo:
    """Validate and convert a ``WorkerInfo``; raises ``InvalidMessage``."""
    if not pb.worker_id:
        raise InvalidMessage("worker.worker_id is empty")
    if not pb.grpc_address:
        raise InvalidMessage("worker.grpc_address is empty")
    role = _ROLE_FROM_PB.get(pb.role)
    if role is None:
        raise InvalidMessage("worker.role is unspecified")
    c = pb.capacity
    capacity = WorkerCapacity(
        total_kv_blocks=c.total_kv_blocks,
        block_size=c.block_size,
        max_num_seqs=c.max_num_seqs,
        max_model_len=c.max_model_len,
        max_num_batched_tokens=c.max_num_batched_tokens,
    )
    for name in ("total_kv_blocks", "block_size", "max_num_seqs", "max_model_len"):
        if getattr(capacity, name) <= 0:
            raise InvalidMessage(f"worker.capacity.{name} must be > 0")
    if capacity.max_num_batched_tokens <= 0:
        raise InvalidMessage("worker.capacity.max_num_batched_tokens must be > 0")
    return WorkerInfo(
        worker_id=pb.worker_id,
        role=role,
        grpc_address=pb.grpc_address,
        capacity=capacity,
        model=pb.model,
        metrics_address=pb.metrics_address,
        transports=tuple(pb.transports),
        host_id=pb.host_id,
        started_unix_ns=pb.started_unix_ns,
        version=pb.version,
        kv_region_digest=pb.kv_region_digest,
        kv_store=pb.kv_store,
    )


def worker_info_to_pb(info: WorkerInfo) -> common_pb2.WorkerInfo:
    """Inverse of ``worker_info_from_pb``."""
    c = info.capacity
    return common_pb2.WorkerInfo(
        worker_id=info.worker_id,
        role=_ROLE_TO_PB[info.role],
        grpc_address=info.grpc_address,
        metrics_address=info.metrics_address,
        transports=list(info.transports),
        model=info.model,
        capacity=common_pb2.WorkerCapacity(
            total_kv_blocks=c.total_kv_blocks,
            block_size=c.block_size,
            max_num_seqs=c.max_num_seqs,
            max_model_len=c.max_model_len,
            max_num_batched_tokens=c.max_num_batched_tokens,
        ),
        host_id=info.host_id,
        started_unix_ns=info.started_unix_ns,
        version=info.version,
        kv_region_digest=info.kv_region_digest,
        kv_store=info.kv_store,
    )


def place_request_from_pb(pb: scheduler_pb2.PlaceRequest) -> PlaceRequest:
    """Validate and convert a ``PlaceRequest``; raises ``InvalidMessage``."""
    if not pb.request_id:
        raise InvalidMessage("request_id is empty")
    if pb.prompt_tokens == 0:
        raise InvalidMessage("prompt_tokens must be >= 1")
    if pb.max_tokens == 0:
        raise InvalidMessage("max_tokens must be >= 1")
    return PlaceRequest(
        request_id=pb.request_id,
        prompt_tokens=pb.prompt_tokens,
        max_tokens=pb.max_tokens,
        model=pb.model,
        attempt=pb.attempt,
        exclude_worker_ids=frozenset(pb.exclude_worker_ids),
        prompt_block_hashes=tuple(pb.prompt_block_hashes),
        hash_block_size=pb.hash_block_size,
    )


def placement_to_pb(placement: Placement) -> scheduler_pb2.Placement:
    """Convert a placement; ``prefill`` stays unset for a local prefill."""
    pb = scheduler_pb2.Placement(
        request_id=placement.request_id,
        decode=worker_info_to_pb(placement.decode),
        expected_cached_tokens=placement.expected_cached_tokens,
        local_prefill_max_tokens=placement.local_prefill_max_tokens,
        fleet_target_batch=placement.fleet_target_batch,
    )
    if placement.prefill is not None:
        pb.prefill.CopyFrom(worker_info_to_pb(placement.prefill))
    return pb


def heartbeat_from_pb(pb: scheduler_pb2.HeartbeatRequest) -> HeartbeatReport:
    """Validate and convert a ``HeartbeatRequest``; raises ``InvalidMessage``."""
    if not pb.worker_id:
        raise InvalidMessage("worker_id is empty")
    state = _STATE_FROM_PB.get(pb.state)
    if state is None:
        raise InvalidMessage("state is unspecified")
    load = pb.load
    return HeartbeatReport(
        worker_id=pb.worker_id,
        state=state,
        sequence=pb.sequence,
        load=WorkerLoad(
            running_requests=load.running_requests,
            waiting_requests=load.waiting_requests,
            free_kv_blocks=load.free_kv_blocks,
            total_kv_blocks=load.total_kv_blocks,
            queued_prompt_tokens=load.queued_prompt_tokens,
            target_batch=load.target_batch,
        ),
        cached_added=tuple(pb.cached_block_hashes_added),
        cached_removed=tuple(pb.cached_block_hashes_removed),
        cache_snapshot=pb.cache_snapshot,
        stored=tuple(pb.stored_block_hashes),
        store_missing=tuple(pb.store_missing_block_hashes),
    )


def outcome_from_pb(pb: scheduler_pb2.Outcome) -> Outcome:
    """Validate and convert an ``Outcome``; raises ``InvalidMessage``."""
    if not pb.request_id:
        raise InvalidMessage("request_id is empty")
    reason = _FINISH_FROM_PB.get(pb.finish_reason)
    if reason is None:
        raise InvalidMessage("finish_reason is unspecified")
    return Outcome(
        request_id=pb.request_id,
        finish_reason=reason,
        attempt=pb.attempt,
        prefill_worker_id=pb.prefill_worker_id,
        decode_worker_id=pb.decode_worker_id,
        error_code=pb.error_code,
        error_message=pb.error_message,
        prompt_tokens=pb.usage.prompt_tokens,
        completion_tokens=pb.usage.completion_tokens,
        cached_tokens=pb.usage.cached_tokens,
        arrival_unix_ns=pb.arrival_unix_ns,
        first_token_unix_ns=pb.first_token_unix_ns,
        finish_unix_ns=pb.finish_unix_ns,
        kv_transfer_bytes=pb.kv_transfer_bytes,
        kv_transfer_seconds=pb.kv_transfer_seconds,
    )


# ---- the servicer ----


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """``pdserve.v1.Scheduler`` over a running ``SchedulerState``."""

    def __init__(
        self,
        state: SchedulerState,
        metrics: SchedulerMetrics,
        *,
        signing_key: Ed25519PrivateKey | None = None,
        placement_token_ttl_s: float = placement_token.DEFAULT_TTL_S,
    ) -> None:
        """``signing_key``: signs a placement token into every placement with a prefill
        worker; its public key goes to every worker in the registration and heartbeat
        replies (default: a fresh key)."""
        self._state = state
        self._metrics = metrics
        self._signing_key = signing_key or placement_token.new_signing_key()
        self.verify_key = placement_token.verify_key_bytes(self._signing_key)
        self._placement_token_ttl_s = placement_token_ttl_s
        self.draining = False
        """Set on shutdown: Place and RegisterWorker answer UNAVAILABLE."""

    async def _fail(
        self, context: grpc.aio.ServicerContext, exc: Exception, retry_after_ms: int = 0
    ) -> NoReturn:
        if isinstance(exc, InvalidMessage):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if isinstance(exc, UnknownWorker):
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        if isinstance(exc, SchedulerOverloaded):
            self._metrics.rejections.labels(RejectReason.OVERLOADED.value).inc()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                str(exc),
                ((RETRY_AFTER_KEY, str(max(1, retry_after_ms))),),
            )
        if isinstance(exc, SchedulerClosed):
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        raise exc

    async def _refuse_when_draining(self, context: grpc.aio.ServicerContext) -> None:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler is draining")

    def _retry_hint_ms(self) -> int:
        return self._state.lease.heartbeat_interval_ms

    async def Place(
        self, request: scheduler_pb2.PlaceRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.Placement:
        await self._refuse_when_draining(context)
        started = time.perf_counter()
        try:
            result = await self._state.place(place_request_from_pb(request))
        except Exception as exc:
            await self._fail(context, exc, self._retry_hint_ms())
        self._metrics.place_seconds.observe(time.perf_counter() - started)
        if isinstance(result, Rejection):
            trailing: tuple[tuple[str, str], ...] = ()
            if result.retry_after_ms:
                trailing = ((RETRY_AFTER_KEY, str(result.retry_after_ms)),)
            log.info("place_rejected", request_id=request.request_id, reason=result.reason.value)
            await context.abort(_REJECT_STATUS[result.reason], result.message, trailing)
        log.debug(
            "placed",
            request_id=result.request_id,
            decode=result.decode.worker_id,
            prefill=result.prefill.worker_id if result.prefill else None,
            mode=result.mode.value,
        )
        pb = placement_to_pb(result)
        if result.prefill is not None:
            claims = placement_token.Claims(
                request_id=result.request_id,
                attempt=request.attempt,
                decode_worker_id=result.decode.worker_id,
                prefill_worker_id=result.prefill.worker_id,
                region_digest=result.decode.kv_region_digest,
                expires_unix_s=time.time() + self._placement_token_ttl_s,
            )
            pb.placement_token = placement_token.mint(self._signing_key, claims)
        return pb

    async def RegisterWorker(
        self, request: scheduler_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.RegisterWorkerReply:
        await self._refuse_when_draining(context)
        try:
            lease = await self._state.register(worker_info_from_pb(request.worker))
        except Exception as exc:
            await self._fail(context, exc, self._retry_hint_ms())
        return scheduler_pb2.RegisterWorkerReply(
            heartbeat_interval_ms=lease.heartbeat_interval_ms,
            lease_ttl_ms=lease.lease_ttl_ms,
            placement_verify_key=self.verify_key,
        )

    async def Heartbeat(
        self, request: scheduler_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.HeartbeatReply:
        try:
            answer = await self._state.heartbeat(heartbeat_from_pb(request))
        except Exception as exc:
            await self._fail(context, exc, self._retry_hint_ms())
        return scheduler_pb2.HeartbeatReply(
            placement_verify_key=self.verify_key,
            resync_cache=answer.resync_cache,
            heartbeat_interval_ms=answer.heartbeat_interval_ms,
        )

    async def DeregisterWorker(
        self, request: scheduler_pb2.DeregisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.DeregisterWorkerReply:
        try:
            await self._state.deregister(request.worker_id)
        except Exception as exc:
            await self._fail(context, exc, self._retry_hint_ms())
        return scheduler_pb2.DeregisterWorkerReply()

    async def ReportOutcome(
        self, request: scheduler_pb2.Outcome, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ReportOutcomeReply:
        try:
            await self._state.report_outcome(outcome_from_pb(request))
        except Exception as exc:
            await self._fail(context, exc, self._retry_hint_ms())
        return scheduler_pb2.ReportOutcomeReply()


# ---- the process ----


class SchedulerServer:
    """The whole scheduler: ``await start()``, serve ``grpc``, ``await drain()`` on SIGTERM,
    then ``await close()`` once ``grpc`` stopped."""

    def __init__(self, config: SchedulerConfig) -> None:
        """``ValueError`` when a key or password file named in ``config`` cannot be used."""
        self.config = config
        self.metrics = SchedulerMetrics()
        self._redis: aioredis.Redis | None = None
        self._store: RedisStore | None = None
        self._watcher: asyncio.Task[None] | None = None
        signing_key = None
        if config.placement_signing_key_file:
            signing_key = placement_token.load_signing_key(config.placement_signing_key_file)
        if config.redis_url:
            password = (
                read_secret(config.redis_password_file, "Redis password file")
                or config.redis_password
            )
            if password is None:
                log.warning(
                    "redis_unauthenticated",
                    detail="no Redis password (--redis-password-file / "
                    "PDSERVE_SCHEDULER_REDIS_PASSWORD): whoever reaches Redis can rewrite "
                    "the scheduler's records",
                )
            self._redis = redis_link.connect(
                config.redis_url,
                config.redis_timeout_s,
                username=config.redis_username or None,
                password=password,
            )
            self._store = RedisStore(
                self._redis,
                lease_ttl_ms=int(config.heartbeat_ttl_s * 1000),
                request_ttl_s=config.request_ttl_s,
                prefix_ttl_s=config.prefix_ttl_s,
                queue_size=config.store_queue_size,
                keys=KeySpace(config.redis_key_prefix),
                call_timeout_s=config.redis_timeout_s,
            )
        sink: RecordSink | None = self._store
        self.state = SchedulerState(config.state_config(), sink=sink, metrics=self.metrics)
        auth = cluster_auth.installed()
        self.servicer = SchedulerServicer(
            self.state,
            self.metrics,
            signing_key=signing_key,
            placement_token_ttl_s=config.placement_token_ttl_s,
        )
        self.grpc = process.GrpcServer(
            [SERVICE_NAME], config.grpc_host, config.grpc_port, auth=auth
        )
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(self.servicer, self.grpc.server)

    async def _restore(self) -> tuple[list[StoredWorker], dict[int, set[str]]] | None:
        """What Redis holds of the registry and prefix index; None when it does not answer."""
        if self._store is None:
            return [], {}
        try:
            async with asyncio.timeout(5 * self.config.redis_timeout_s):
                workers = await self._store.load_workers()
                index = await self._store.load_prefix_index(w.info.worker_id for w in workers)
        except (aioredis.RedisError, OSError, TimeoutError) as exc:
            # Workers re-register when their heartbeat answers NOT_FOUND: a cold start is
            # slower, not wrong.
            log.warning("registry_restore_failed", error=str(exc))
            return None
        return workers, index

    async def start(self) -> None:
        """Restore from Redis, start the state loop, the Redis writer and probe, and
        /metrics (gRPC: ``grpc``)."""
        restored = await self._restore()
        workers, index = restored if restored is not None else ([], {})
        self.state.restore(workers, index)
        self.state.start()
        if self._store is not None and self._redis is not None:
            self._store.start()
            # Restored: Redis holds what memory holds. Not: write it all once Redis answers.
            link = redis_link.Link(up=restored is not None)
            self._watcher = asyncio.create_task(
                redis_link.watch(
                    self._redis,
                    link,
                    interval_s=self.config.redis_probe_s,
                    timeout_s=self.config.redis_timeout_s,
                    remirror=self.state.request_mirror,
                    on_change=lambda seen: self.metrics.redis_up.set(int(seen.up)),
                ),
                name="scheduler-redis-probe",
            )
        store = self._store
        self.metrics.watch(
            queue_depth=lambda: self.state.queue_depth,
            store_pending=lambda: store.pending if store else 0,
            store_dropped=lambda: store.dropped if store else 0,
        )
        process.start_metrics(
            self.config.metrics_port, self.config.metrics_host, self.metrics.registry
        )
        log.info(
            "scheduler_started",
            grpc_port=self.grpc.port,
            metrics_port=self.config.metrics_port,
            restored_workers=len(workers),
            restored_prefixes=len(index),
            heartbeat_ttl_s=self.config.heartbeat_ttl_s,
        )

    async def drain(self) -> None:
        """Refuse new placements and registrations; RPCs in flight go on."""
        self.servicer.draining = True

    async def close(self) -> None:
        """After the gRPC server stopped: stop the state loop, flush Redis writes, close."""
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await self.state.stop()
        if self._store is not None:
            await self._store.close(timeout_s=self.config.redis_timeout_s)
        if self._redis is not None:
            await self._redis.aclose()

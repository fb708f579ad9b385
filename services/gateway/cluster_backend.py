"""The disaggregated backend: the scheduler places a request, a decode worker streams it.

Lifecycle: ``Place`` (scheduler: admission, prefill and decode worker choice, prefix-aware:
the prompt's block hashes in the workers' block size, ``prefix_hashes``)
-> ``DecodeWorker.Generate`` with the chosen prefill worker's address (the decode worker
reserves KV, has the prefill worker fill it, then streams tokens) -> chunks to the client
-> ``ReportOutcome`` to the scheduler (fire-and-forget: the scheduler is off the token path).
Closing the iterator cancels the decode call, which frees the KV on both workers.

Migration: when a decode stream breaks (the worker died or went away: UNAVAILABLE and
kin; a worker gone silent, its host cut off, is found by keepalive pings and breaks the same
way) or its prefill failed (the decode worker names the prefill worker in the trailing
metadata), the request is placed again without the worker at fault and the new decode
worker is sent ``resume_token_ids`` = the tokens the client already has; it continues after
them, so the client sees one stream, no token twice or missing. ``migration.py`` says which
breakages move a request: a lost worker, at most ``max_migrations`` times; a failure that
may be the request's own, once (the same failure twice ends it). A migrating request was
admitted already, so when no worker has room for it (a 429: its old KV blocks may be held
by a lease for a while) it waits, with backoff, up to ``MIGRATION_ROOM_WAIT_S``. Each
attempt's decode stream has a deadline of ``generate_timeout_s``.

Room. A new request that finds no room before its first token waits for it the same way,
up to ``room_wait_s`` (the gateway's queue timeout), then gets the 429: the scheduler found
no worker with room, or the decode worker it chose refused the reservation (its batch is
at its ITL target's size: the scheduler's view of it lags a heartbeat). Each try is a new
attempt (``Place`` is idempotent per attempt). The gateway's cap follows the fleet's batch
target (``admission``), so this is the exception: the burst before the first placement, a
finished stream the scheduler still counts, or gateways that together admit more than the
fleet takes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import secrets
import time
from collections.abc import AsyncIterator, Callable

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.errors import InvalidRequestError, ResourceExhaustedError
from pdserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common import cluster_auth
from services.common.background import Background
from services.common.channels import SCHEDULER_CHANNEL_OPTIONS, ChannelPool, keepalive_options
from services.common.convert import (
    FAILED_WORKER_KEY,
    finish_from_proto,
    sampling_to_proto,
    top_logprobs_from_proto,
)
from services.gateway.backend import (
    BackendUnavailableError,
    GenerateChunk,
    GenerateInput,
    ServedBy,
)
from services.gateway.migration import Breakage, MigrationHistory, classify
from services.gateway.prefix_hashes import PrefixHashes

log = structlog.get_logger(__name__)

PLACE_TIMEOUT_S = 5.0
# A migrating request was admitted already: when no worker has room for it now (its old
# blocks may be held by a KV lease for a while), it waits this long for room, not a 429.
MIGRATION_ROOM_WAIT_S = 60.0


def cluster_request_id(request_id: str) -> str:
    """The id a request goes by inside the cluster (scheduler, workers, Redis, logs): the
    caller's and a suffix of the gateway's. A client-chosen id (gRPC) may be another
    client's too, and the scheduler's Place is idempotent per id, so two requests sharing
    one would share a placement."""
    return f"{request_id}~{secrets.token_hex(4)}"


def client_request_id(cluster_id: str) -> str:
    """The caller's id of a request that goes by ``cluster_id`` inside the cluster."""
    return cluster_id.rsplit("~", 1)[0]


class _RoomWait:
    """Backoff for a request that finds no room (429) until ``total_s`` passed."""

    def __init__(self, total_s: float) -> None:
        self.give_up = time.monotonic() + total_s
        self.delay = 0.1

    async def wait(self) -> bool:
        """Sleep the next backoff step; False (no sleep) once the time is up."""
        if time.monotonic() + self.delay > self.give_up:
            return False
        await asyncio.sleep(self.delay)
        self.delay = min(2 * self.delay, 2.0)
        return True


class _Broken(Exception):
    """One attempt failed in a way another placement may not: maybe move the request."""

    def __init__(self, breakage: Breakage, error: grpc.aio.AioRpcError) -> None:
        super().__init__(str(breakage))
        self.breakage = breakage
        self.error = error


def _broken(e: grpc.aio.AioRpcError, decode_worker_id: str) -> _Broken | None:
    failed = dict(e.trailing_metadata() or ()).get(FAILED_WORKER_KEY)
    b = classify(e.code(), e.details() or "", decode_worker_id, str(failed) if failed else None)
    return None if b is None else _Broken(b, e)


def _error_for(e: grpc.aio.AioRpcError, what: str) -> Exception:
    code, details = e.code(), e.details() or ""
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        return InvalidRequestError(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhaustedError(details or f"{what}: no capacity")
    return BackendUnavailableError(f"{what}: {code.name}: {details}")


def chunk_from_event(
    ev: worker_pb2.DecodeEvent, req: GenerateInput, completion_tokens: int, decode_worker_id: str
) -> GenerateChunk:
    """The chunk of one decode event; ``completion_tokens``: the running total with it.
    The last event's usage, prefill worker and KV bytes, and the decode worker that sent it,
    go on the last chunk only."""
    reason = finish_from_proto(ev.finish_reason)
    last = reason is not None
    return GenerateChunk(
        text_delta=ev.text,
        token_ids=tuple(ev.token_ids),
        logprobs=tuple(ev.logprobs) if req.params.logprobs else (),
        finish_reason=reason,
        prompt_tokens=len(req.prompt_token_ids),
        completion_tokens=completion_tokens,
        cached_tokens=ev.usage.cached_tokens if last else 0,
        produced_unix_ns=ev.produced_unix_ns,
        served_by=(
            ServedBy(ev.prefill_worker_id, decode_worker_id, ev.kv_transfer_bytes)
            if last
            else ServedBy()
        ),
        top_logprobs=tuple(top_logprobs_from_proto(t) for t in ev.top_logprobs),
    )


class ClusterBackend:
    def __init__(
        self,
        scheduler_address: str,
        *,
        worker_model: str = "",
        generate_timeout_s: float = 600.0,
        max_migrations: int = 3,
        worker_keepalive_s: float = 5.0,
        room_wait_s: float = 30.0,
    ) -> None:
        """``worker_model``: the model name workers register with (the scheduler matches
        requests to workers by it; the name clients use may be an alias).
        ``max_migrations``: how many times one request may be placed again.
        ``worker_keepalive_s``: the keepalive of decode worker connections: a stream whose
        worker went silent (its host cut off) breaks within about twice this, and moves.
        ``room_wait_s``: how long a new request waits for room (module docstring)."""
        self.scheduler_address = scheduler_address
        self.worker_model = worker_model
        self.generate_timeout_s = generate_timeout_s
        self.max_migrations = max_migrations
        self.room_wait_s = room_wait_s
        self._worker_channel_options = keepalive_options(worker_keepalive_s)
        # Called with the cause of every migration (the gateway's metrics count them).
        self.on_migration: Callable[[str], None] = lambda cause: None
        # Called with the fleet's target batch every placement tells (admission follows it).
        self.on_target_batch: Callable[[int], None] = lambda n: None
        self._sched_channel: grpc.aio.Channel | None = None
        self._channels = ChannelPool(
            lambda address: cluster_auth.channel(address, options=self._worker_channel_options)
        )
        self._background = Background()
        self.prefix_hashes = PrefixHashes(worker_model)

    def start(self) -> None:
        """Open the scheduler channel; call on the event loop that will use it."""
        self._sched_channel = cluster_auth.channel(
            self.scheduler_address, options=SCHEDULER_CHANNEL_OPTIONS
        )
        self._sched = scheduler_pb2_grpc.SchedulerStub(self._sched_channel)
        self._health = health_pb2_grpc.HealthStub(self._sched_channel)

    async def stop(self, timeout: float = 10.0) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channels.close()
        if self._sched_channel is not None:
            await self._sched_channel.close()

    async def ready(self) -> bool:
        try:
            r = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.aio.AioRpcError:
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING

    async def place(
        self, req: GenerateInput, attempt: int = 0, exclude: list[str] | None = None
    ) -> scheduler_pb2.Placement:
        """Ask the scheduler where attempt ``attempt`` of ``req`` runs, not on the workers
        in ``exclude``; the prompt's block hashes go with it (``prefix_hashes``)."""
        hashes, block_size = self.prefix_hashes.of(req.prompt_token_ids)
        try:
            placement = await self._sched.Place(
                scheduler_pb2.PlaceRequest(
                    request_id=req.request_id,
                    attempt=attempt,
                    exclude_worker_ids=exclude or [],
                    model=self.worker_model,
                    prompt_tokens=len(req.prompt_token_ids),
                    max_tokens=req.params.max_tokens,
                    prompt_block_hashes=hashes,
                    hash_block_size=block_size,
                ),
                timeout=PLACE_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as e:
            raise _error_for(e, "scheduler") from e
        self.prefix_hashes.learn(placement)
        self.on_target_batch(placement.fleet_target_batch)
        return placement

    async def generate(self, req: GenerateInput) -> AsyncIterator[GenerateChunk]:
        req = dataclasses.replace(req, request_id=cluster_request_id(req.request_id))
        arrival_ns = time.time_ns()
        received: list[int] = []  # token ids the client has, over every attempt
        exclude: list[str] = []
        history = MigrationHistory(self.max_migrations)
        room = _RoomWait(self.room_wait_s)  # module docstring, "Room"
        for attempt in itertools.count():  # Place is idempotent per (request, attempt)
            try:
                placement = await self.place(req, attempt, exclude)
                async for chunk in self._attempt(req, placement, attempt, received, arrival_ns):
                    received.extend(chunk.token_ids)
                    yield chunk
                return
            except ResourceExhaustedError:
                if not await room.wait():
                    raise
            except _Broken as broken:
                b = broken.breakage
                exclude.append(b.worker_id)
                reason = history.give_up(b)
                if reason is not None:
                    log.warning("request_not_moved", request_id=req.request_id, reason=reason)
                    raise BackendUnavailableError(reason) from broken.error
                room = _RoomWait(MIGRATION_ROOM_WAIT_S)
                self.on_migration(b.cause)
                log.warning(
                    "request_migrating",
                    request_id=req.request_id,
                    cause=b.cause,
                    failed_worker_id=b.worker_id,
                    code=b.code.name,
                    tokens_received=len(received),
                    migration=len(history.breakages),
                )
        raise AssertionError("unreachable")

    async def _attempt(
        self,
        req: GenerateInput,
        placement: scheduler_pb2.Placement,
        attempt: int,
        received: list[int],
        arrival_ns: int,
    ) -> AsyncIterator[GenerateChunk]:
        """One placement's decode stream; raises ``_Broken`` when another may carry on."""
        decode = placement.decode
        prefill_addr = placement.prefill.grpc_address if placement.HasField("prefill") else ""
        channel = self._channels.acquire(decode.grpc_address)  # released below
        call = worker_pb2_grpc.DecodeWorkerStub(channel).Generate(
            worker_pb2.DecodeGenerateRequest(
                request_id=req.request_id,
                prompt_token_ids=list(req.prompt_token_ids),
                sampling=sampling_to_proto(req.params),
                prefill_address=prefill_addr,
                prefill_worker_id=placement.prefill.worker_id if prefill_addr else "",
                resume_token_ids=received,
                placement_token=placement.placement_token,
                attempt=attempt,
                local_prefill_max_tokens=placement.local_prefill_max_tokens,
            ),
            timeout=self.generate_timeout_s,
        )
        outcome = scheduler_pb2.Outcome(
            request_id=req.request_id,
            attempt=attempt,
            decode_worker_id=decode.worker_id,
            prefill_worker_id=""
            if placement.local_prefill_max_tokens
            else (placement.prefill.worker_id if prefill_addr else ""),
            arrival_unix_ns=arrival_ns,
        )
        completion = len(received)
        finished = False
        try:
            async for ev in call:
                completion += len(ev.token_ids)
                if not outcome.first_token_unix_ns and ev.token_ids:
                    outcome.first_token_unix_ns = time.time_ns()
                reason = finish_from_proto(ev.finish_reason)
                if reason is not None:
                    finished = True
                    outcome.finish_reason = ev.finish_reason
                    outcome.prefill_worker_id = ev.prefill_worker_id  # "" when prefilled here
                    outcome.usage.CopyFrom(ev.usage)
                    outcome.kv_transfer_bytes = ev.kv_transfer_bytes
                yield chunk_from_event(ev, req, completion, decode.worker_id)
        except grpc.aio.AioRpcError as e:
            if finished:  # the worker went away after its last event: the stream is whole
                log.info("decode_lost_after_finish", request_id=req.request_id)
                return
            outcome.finish_reason = common_pb2.FINISH_REASON_ERROR
            outcome.error_code = e.code().value[0]
            outcome.error_message = e.details() or ""
            broken = _broken(e, decode.worker_id)
            if broken is not None:
                raise broken from e
            raise _error_for(e, f"decode worker {decode.worker_id}") from e
        finally:
            if not finished:
                call.cancel()  # the client went away: the decode worker frees the KV
                if not outcome.finish_reason:
                    outcome.finish_reason = common_pb2.FINISH_REASON_ABORT
            outcome.finish_unix_ns = time.time_ns()
            self._report(outcome)
            self._channels.release(decode.grpc_address)

    def _report(self, outcome: scheduler_pb2.Outcome) -> None:
        async def send() -> None:
            try:
                await self._sched.ReportOutcome(outcome, timeout=2.0)
            except grpc.aio.AioRpcError as e:
                log.debug("outcome_report_failed", code=e.code().name)

        self._background.spawn(send())

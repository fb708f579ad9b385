"""A worker's membership in the scheduler's registry: register, then heartbeat its load
and its prefix-cache events.

The scheduler drops a worker whose heartbeats stop for longer than the lease TTL, so a
crashed worker disappears on its own. Heartbeat failures are logged and retried at the
next interval; a worker never blocks serving on the scheduler (it is off the token path).

KV events: the engine records what its prefix cache gained and lost (``CacheEventLog``);
every heartbeat carries the net change since the previous one. A heartbeat is also sent
early, at most every ``event_interval_s``, when the cache changed, so the scheduler routes
by a view at most that old plus one RPC (the engine thread only appends to the log; the
publishing is here, on the event loop). The first heartbeat after registering, any
heartbeat after a failed one, one the scheduler asked for (``resync_cache``: it saw a gap
in the sequence) and one after the log overflowed carry a snapshot: the whole cached set.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import grpc
import structlog

from engine.cache_events import CacheEventLog
from pdserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common import cluster_auth
from services.common.channels import SCHEDULER_CHANNEL_OPTIONS
from services.common.placement_token import VerifyKeys

log = structlog.get_logger(__name__)

_RPC_TIMEOUT_S = 2.0
EVENT_INTERVAL_S = 0.05


class StoreReports(Protocol):
    """What a worker's KV store learned since it was last asked (``StoreLink``)."""

    def confirmed(self) -> list[int]: ...

    def missing(self) -> list[int]: ...


class Registrar:
    def __init__(
        self,
        scheduler_address: str,
        info: common_pb2.WorkerInfo,
        load: Callable[[], scheduler_pb2.LoadSnapshot],
        *,
        interval_s: float = 1.0,
        cache: CacheEventLog | None = None,
        event_interval_s: float = EVENT_INTERVAL_S,
        store: StoreReports | None = None,
        verify_keys: VerifyKeys | None = None,
    ) -> None:
        """``store``: the worker's KV store link; each heartbeat carries the blocks it
        confirmed there and found missing there since the previous one. ``verify_keys``:
        where the scheduler's placement public key goes, from every reply (a prefill worker
        checks tokens against them)."""
        self.info = info
        self.verify_keys = verify_keys if verify_keys is not None else VerifyKeys()
        self._load = load
        self._cache = cache
        self._store = store
        self.interval_s = interval_s
        self.event_interval_s = event_interval_s
        self._channel = cluster_auth.channel(scheduler_address, options=SCHEDULER_CHANNEL_OPTIONS)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._seq = 0
        self._registered = False
        self._snapshot_due = True
        self.draining = False

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not await self._tick():
                    # The scheduler forgot this worker (it restarted cold, or the lease
                    # lapsed): register again now rather than one interval later.
                    await self._tick()
                due = loop.time() + self.interval_s
                while loop.time() < due and not self._events_waiting():
                    await asyncio.sleep(min(self.event_interval_s, due - loop.time()))
        finally:
            await self._channel.close()

    def _events_waiting(self) -> bool:
        return self._registered and self._cache is not None and self._cache.has_pending

    def _cache_fields(self) -> dict[str, object]:
        """The heartbeat's prefix-cache fields: a snapshot when due, else the delta."""
        if self._cache is None:
            return {}
        if not self._snapshot_due:
            delta = self._cache.drain()
            if not delta.overflowed:
                return {
                    "cached_block_hashes_added": delta.added,
                    "cached_block_hashes_removed": delta.removed,
                }
        return {"cached_block_hashes_added": self._cache.snapshot(), "cache_snapshot": True}

    async def _tick(self) -> bool:
        """Register if needed, then heartbeat. False when the scheduler no longer knows this
        worker (``NOT_FOUND``); the next call registers again."""
        try:
            if not self._registered:
                lease = await self._stub.RegisterWorker(
                    scheduler_pb2.RegisterWorkerRequest(worker=self.info), timeout=_RPC_TIMEOUT_S
                )
                if lease.heartbeat_interval_ms:
                    self.interval_s = lease.heartbeat_interval_ms / 1000
                self.verify_keys.add(lease.placement_verify_key)
                self._registered = True
                self._snapshot_due = True
                self._seq = 0  # a new registration starts a new heartbeat sequence
                log.info("registered", worker_id=self.info.worker_id)
            fields = self._cache_fields()
            if self._store is not None:
                fields["stored_block_hashes"] = self._store.confirmed()
                fields["store_missing_block_hashes"] = self._store.missing()
            # Until the scheduler answers, the next heartbeat sends a snapshot: a delta lost
            # with a failed call cannot be sent again.
            self._snapshot_due = True
            reply = await self._stub.Heartbeat(
                scheduler_pb2.HeartbeatRequest(
                    worker_id=self.info.worker_id,
                    state=scheduler_pb2.WORKER_STATE_DRAINING
                    if self.draining
                    else scheduler_pb2.WORKER_STATE_SERVING,
                    sequence=self._seq,
                    load=self._load(),
                    **fields,  # type: ignore[arg-type]
                ),
                timeout=_RPC_TIMEOUT_S,
            )
            self._seq += 1
            self._snapshot_due = reply.resync_cache
            self.verify_keys.add(reply.placement_verify_key)
        except grpc.aio.AioRpcError as e:
            log.warning("heartbeat_failed", code=e.code().name, details=e.details())
            if e.code() == grpc.StatusCode.NOT_FOUND:
                self._registered = False  # the scheduler forgot us (restart, lease lapsed)
                return False
        return True

    async def deregister(self) -> None:
        try:
            await self._stub.DeregisterWorker(
                scheduler_pb2.DeregisterWorkerRequest(worker_id=self.info.worker_id),
                timeout=_RPC_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as e:
            log.warning("deregister_failed", code=e.code().name)

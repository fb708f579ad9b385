"""A worker's membership in the scheduler's registry: register, then heartbeat its load.

The scheduler drops a worker whose heartbeats stop for longer than the lease TTL, so a
crashed worker disappears on its own. Heartbeat failures are logged and retried at the
next interval; a worker never blocks serving on the scheduler (it is off the token path).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import structlog

from pdserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common import cluster_auth
from services.common.reconnect import SCHEDULER_CHANNEL_OPTIONS

log = structlog.get_logger(__name__)

_RPC_TIMEOUT_S = 2.0


class Registrar:
    def __init__(
        self,
        scheduler_address: str,
        info: common_pb2.WorkerInfo,
        load: Callable[[], scheduler_pb2.LoadSnapshot],
        *,
        interval_s: float = 1.0,
    ) -> None:
        self.info = info
        self._load = load
        self.interval_s = interval_s
        self._channel = cluster_auth.channel(scheduler_address, options=SCHEDULER_CHANNEL_OPTIONS)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._seq = 0
        self._registered = False
        self.draining = False

    async def run(self) -> None:
        try:
            while True:
                await self._tick()
                await asyncio.sleep(self.interval_s)
        finally:
            await self._channel.close()

    async def _tick(self) -> None:
        try:
            if not self._registered:
                reply = await self._stub.RegisterWorker(
                    scheduler_pb2.RegisterWorkerRequest(worker=self.info), timeout=_RPC_TIMEOUT_S
                )
                if reply.heartbeat_interval_ms:
                    self.interval_s = reply.heartbeat_interval_ms / 1000
                self._registered = True
                self._seq = 0  # a new registration starts a new heartbeat sequence
                log.info("registered", worker_id=self.info.worker_id)
            await self._stub.Heartbeat(
                scheduler_pb2.HeartbeatRequest(
                    worker_id=self.info.worker_id,
                    state=scheduler_pb2.WORKER_STATE_DRAINING
                    if self.draining
                    else scheduler_pb2.WORKER_STATE_SERVING,
                    sequence=self._seq,
                    load=self._load(),
                ),
                timeout=_RPC_TIMEOUT_S,
            )
            self._seq += 1
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                self._registered = False  # the scheduler forgot us (restart, lease lapsed)
            log.warning("heartbeat_failed", code=e.code().name, details=e.details())

    async def deregister(self) -> None:
        try:
            await self._stub.DeregisterWorker(
                scheduler_pb2.DeregisterWorkerRequest(worker_id=self.info.worker_id),
                timeout=_RPC_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as e:
            log.warning("deregister_failed", code=e.code().name)

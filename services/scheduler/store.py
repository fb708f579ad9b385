"""Redis I/O of the scheduler: worker registry, request records and the prefix index.

Keys (``{p}`` is the key prefix, ``pdserve`` by default; docs/redis.md has the full table):

* ``{p}:worker:{worker_id}``   hash, TTL = the heartbeat lease, refreshed on every heartbeat
* ``{p}:request:{request_id}`` hash, TTL = the request-record TTL, refreshed on every write
* ``{p}:prefix:{block_hash}``  set of worker ids, TTL = the prefix TTL, refreshed on add

Writes are fire-and-forget: the state loop calls the non-blocking ``put_*``/``record_*``
methods, which only append an operation to a bounded queue; one writer task (``start``,
``close``) drains it in pipelined batches, each call under a deadline. Placement therefore
never waits on Redis. A batch Redis refuses is retried a few times, then dropped; a batch
that does not reach Redis (down, restarting) is retried every second until it does, so a
short outage loses nothing while the queue holds (``retry_delay``). When the queue is full
the operation is dropped and counted (``dropped``): a lost record costs observability or a
slower warm restart, never a wrong placement. What Redis lost in a restart the state loop
writes again (``redis_link``: re-mirror).

Reads happen once, at start-up (``load_workers``, ``load_prefix_index``), before the
scheduler serves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import redis.asyncio as aioredis
import structlog
from redis.asyncio.client import Pipeline

from services.scheduler.model import (
    FinishReason,
    Outcome,
    Placement,
    PlaceRequest,
    PrefillMode,
    Role,
    WorkerCapacity,
    WorkerInfo,
    WorkerLoad,
    WorkerState,
)
from services.scheduler.redis_link import UNREACHABLE

log = structlog.get_logger(__name__)

WriteOp = Callable[[Pipeline], None]

_BATCH_MAX_OPS = 256
_RETRY_BACKOFF_S = (0.05, 0.2, 0.5)
_UNREACHABLE_BACKOFF_S = 1.0
_SCAN_COUNT = 1000

_STATUS_OF = {
    FinishReason.STOP: "finished",
    FinishReason.LENGTH: "finished",
    FinishReason.ABORT: "aborted",
    FinishReason.ERROR: "failed",
}


class RecordSink(Protocol):
    """Where the state loop sends what Redis should remember. Every method returns at once."""

    def put_worker(
        self,
        info: WorkerInfo,
        state: WorkerState,
        load: WorkerLoad,
        registered_unix_ns: int,
    ) -> None: ...

    def delete_worker(self, worker_id: str, cached_hashes: Iterable[int]) -> None: ...

    def update_prefixes(
        self, worker_id: str, added: Iterable[int], removed: Iterable[int]
    ) -> None: ...

    def record_placement(self, req: PlaceRequest, placement: Placement) -> None: ...

    def record_outcome(self, outcome: Outcome) -> None: ...


class NullSink:
    """A sink that remembers nothing: the scheduler without Redis (no warm restart)."""

    def put_worker(
        self, info: WorkerInfo, state: WorkerState, load: WorkerLoad, registered_unix_ns: int
    ) -> None:
        pass

    def delete_worker(self, worker_id: str, cached_hashes: Iterable[int]) -> None:
        pass

    def update_prefixes(self, worker_id: str, added: Iterable[int], removed: Iterable[int]) -> None:
        pass

    def record_placement(self, req: PlaceRequest, placement: Placement) -> None:
        pass

    def record_outcome(self, outcome: Outcome) -> None:
        pass


@dataclass(frozen=True)
class StoredWorker:
    """A worker key read back at start-up (one whose lease had not lapsed)."""

    info: WorkerInfo
    state: WorkerState
    load: WorkerLoad
    registered_unix_ns: int


@dataclass(frozen=True)
class KeySpace:
    """The names of every key the scheduler owns."""

    prefix: str = "pdserve"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    def request(self, request_id: str) -> str:
        return f"{self.prefix}:request:{request_id}"

    def block(self, block_hash: int) -> str:
        return f"{self.prefix}:prefix:{block_hash}"

    def worker_pattern(self) -> str:
        return f"{self.prefix}:worker:*"

    def prefix_pattern(self) -> str:
        return f"{self.prefix}:prefix:*"


def worker_info_to_json(info: WorkerInfo) -> str:
    """Serialise ``info`` (the ``info`` field of a worker key)."""
    data = dataclasses.asdict(info)
    data["role"] = info.role.value
    data["transports"] = list(info.transports)
    return json.dumps(data, separators=(",", ":"), sort_keys=True)


def worker_info_from_json(text: str) -> WorkerInfo:
    """Inverse of ``worker_info_to_json``; raises ``ValueError``/``KeyError`` on bad input."""
    data: dict[str, Any] = json.loads(text)
    data["role"] = Role(data["role"])
    data["transports"] = tuple(data.get("transports", ()))
    data["capacity"] = WorkerCapacity(**data["capacity"])
    return WorkerInfo(**data)


def retry_delay(attempt: int, *, unreachable: bool) -> float | None:
    """Seconds before the ``attempt``-th retry of a failed batch (0: the first), or None: drop
    it. A batch Redis refused gets a few retries; one that did not reach Redis waits for it.

    >>> [retry_delay(a, unreachable=False) for a in range(4)]
    [0.05, 0.2, 0.5, None]
    >>> retry_delay(100, unreachable=True)
    1.0
    """
    if attempt < len(_RETRY_BACKOFF_S):
        return _RETRY_BACKOFF_S[attempt]
    return _UNREACHABLE_BACKOFF_S if unreachable else None


def _load_to_json(load: WorkerLoad) -> str:
    return json.dumps(dataclasses.asdict(load), separators=(",", ":"), sort_keys=True)


class RedisStore:
    """Write-behind Redis store; see the module docstring for the keys and guarantees.

    ``start()`` runs the writer task; ``close()`` lets it write what is queued (bounded by a
    deadline) and stops it.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        lease_ttl_ms: int,
        request_ttl_s: float,
        prefix_ttl_s: float,
        queue_size: int = 4096,
        keys: KeySpace | None = None,
        call_timeout_s: float = 2.0,
    ) -> None:
        self._client = client
        self._call_timeout_s = call_timeout_s
        self._lease_ttl_ms = lease_ttl_ms
        self._request_ttl_ms = int(request_ttl_s * 1000)
        self._prefix_ttl_ms = int(prefix_ttl_s * 1000)
        self._queue: asyncio.Queue[WriteOp] = asyncio.Queue(maxsize=queue_size)
        self.keys = keys or KeySpace()
        self.dropped = 0
        """Operations lost to a full queue or to Redis failing every retry."""
        self.written = 0
        """Operations Redis acknowledged."""
        self._writer: asyncio.Task[None] | None = None
        self._busy = False

    # ---- fire-and-forget writes (called from the state loop) ----

    def _enqueue(self, op: WriteOp) -> None:
        try:
            self._queue.put_nowait(op)
        except asyncio.QueueFull:
            self.dropped += 1

    def put_worker(
        self, info: WorkerInfo, state: WorkerState, load: WorkerLoad, registered_unix_ns: int
    ) -> None:
        """Write the whole worker hash and renew its TTL to one lease."""
        key = self.keys.worker(info.worker_id)
        mapping = {
            "info": worker_info_to_json(info),
            "state": state.value,
            "load": _load_to_json(load),
            "registered_unix_ns": registered_unix_ns,
            "heartbeat_unix_ns": time.time_ns(),
            "lease_ttl_ms": self._lease_ttl_ms,
        }
        ttl = self._lease_ttl_ms

        def op(pipe: Pipeline) -> None:
            pipe.hset(key, mapping=mapping)
            pipe.pexpire(key, ttl)

        self._enqueue(op)

    def delete_worker(self, worker_id: str, cached_hashes: Iterable[int]) -> None:
        """Delete the worker key and take the worker out of its prefix sets."""
        key = self.keys.worker(worker_id)
        block_keys = [self.keys.block(h) for h in cached_hashes]

        def op(pipe: Pipeline) -> None:
            pipe.delete(key)
            for block_key in block_keys:
                pipe.srem(block_key, worker_id)

        self._enqueue(op)

    def update_prefixes(self, worker_id: str, added: Iterable[int], removed: Iterable[int]) -> None:
        """Add the worker to the sets of ``added`` (renewing their TTL), remove it from
        ``removed``."""
        add_keys = [self.keys.block(h) for h in added]
        remove_keys = [self.keys.block(h) for h in removed]
        if not add_keys and not remove_keys:
            return
        ttl = self._prefix_ttl_ms

        def op(pipe: Pipeline) -> None:
            for block_key in add_keys:
                pipe.sadd(block_key, worker_id)
                pipe.pexpire(block_key, ttl)
            for block_key in remove_keys:
                pipe.srem(block_key, worker_id)

        self._enqueue(op)

    def record_placement(self, req: PlaceRequest, placement: Placement) -> None:
        """Create or overwrite the request record with status ``placed``."""
        key = self.keys.request(req.request_id)
        mapping = {
            "status": "placed",
            "attempt": placement.attempt,
            "model": req.model,
            "prefill": placement.prefill.worker_id
            if placement.prefill and placement.mode is PrefillMode.DISAGGREGATED
            else "",
            "decode": placement.decode.worker_id,
            "prefill_mode": placement.mode.value,
            "prompt_tokens": req.prompt_tokens,
            "max_tokens": req.max_tokens,
            "expected_cached_tokens": placement.expected_cached_tokens,
            "placed_unix_ns": time.time_ns(),
        }
        self._write_request(key, mapping)

    def record_outcome(self, outcome: Outcome) -> None:
        """Add the outcome to the request record (status ``finished``/``aborted``/``failed``)."""
        key = self.keys.request(outcome.request_id)
        mapping = {
            "status": _STATUS_OF[outcome.finish_reason],
            "finish_reason": outcome.finish_reason.value,
            "attempt": outcome.attempt,
            "error_code": outcome.error_code,
            "error_message": outcome.error_message,
            "prompt_tokens": outcome.prompt_tokens,
            "completion_tokens": outcome.completion_tokens,
            "cached_tokens": outcome.cached_tokens,
            "arrival_unix_ns": outcome.arrival_unix_ns,
            "first_token_unix_ns": outcome.first_token_unix_ns,
            "finish_unix_ns": outcome.finish_unix_ns,
            "kv_transfer_bytes": outcome.kv_transfer_bytes,
            "kv_transfer_seconds": outcome.kv_transfer_seconds,
            "outcome_unix_ns": time.time_ns(),
        }
        # A record placed before a scheduler restart (or lost) still gets its outcome.
        if outcome.prefill_worker_id:
            mapping["prefill"] = outcome.prefill_worker_id
        if outcome.decode_worker_id:
            mapping["decode"] = outcome.decode_worker_id
        self._write_request(key, mapping)

    def _write_request(self, key: str, mapping: Mapping[str, Any]) -> None:
        ttl = self._request_ttl_ms

        def op(pipe: Pipeline) -> None:
            pipe.hset(key, mapping=dict(mapping))
            pipe.pexpire(key, ttl)

        self._enqueue(op)

    # ---- the writer task ----

    @property
    def pending(self) -> int:
        """Operations queued and not yet written."""
        return self._queue.qsize()

    def start(self) -> None:
        """Start the writer task on the running loop."""
        if self._writer is None:
            self._writer = asyncio.create_task(self._run(), name="scheduler-redis-writer")

    async def close(self, timeout_s: float) -> bool:
        """Let the writer finish what is queued (at most ``timeout_s``), then stop it.

        Returns False when operations were still queued or in flight at the deadline.
        """
        deadline = time.monotonic() + timeout_s
        while (self._busy or not self._queue.empty()) and time.monotonic() < deadline:
            if self._writer is None or self._writer.done():
                break
            await asyncio.sleep(0.01)
        drained = not self._busy and self._queue.empty()
        if self._writer is not None:
            self._writer.cancel()
            try:
                await self._writer
            except asyncio.CancelledError:
                pass
            self._writer = None
        self.dropped += self._queue.qsize()
        return drained

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < _BATCH_MAX_OPS and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            self._busy = True
            try:
                await self._write_batch(batch)
            except asyncio.CancelledError:
                self.dropped += len(batch)
                raise
            finally:
                self._busy = False

    async def _write_batch(self, batch: list[WriteOp]) -> None:
        attempt = 0
        while True:
            try:
                pipe = self._client.pipeline(transaction=False)
                for op in batch:
                    op(pipe)
                async with asyncio.timeout(self._call_timeout_s):
                    await pipe.execute()
                self.written += len(batch)
                return
            except (*UNREACHABLE, aioredis.RedisError) as exc:
                delay = retry_delay(attempt, unreachable=isinstance(exc, UNREACHABLE))
                if delay is None:
                    self.dropped += len(batch)
                    log.warning("redis_write_dropped", ops=len(batch), error=str(exc))
                    return
                if attempt == len(_RETRY_BACKOFF_S):
                    log.warning("redis_unreachable_holding_writes", ops=len(batch))
                log.debug("redis_write_retry", attempt=attempt + 1, error=str(exc))
                attempt += 1
                await asyncio.sleep(delay)

    # ---- start-up reads ----

    async def load_workers(self) -> list[StoredWorker]:
        """Read every worker key still alive in Redis (unparseable ones are skipped)."""
        keys = [k async for k in self._client.scan_iter(self.keys.worker_pattern(), _SCAN_COUNT)]
        if not keys:
            return []
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        replies = await pipe.execute()
        workers: list[StoredWorker] = []
        for key, fields in zip(keys, replies, strict=True):
            if not fields:
                continue  # expired between SCAN and HGETALL
            try:
                fields = {_text(k): _text(v) for k, v in fields.items()}
                workers.append(
                    StoredWorker(
                        info=worker_info_from_json(fields["info"]),
                        state=WorkerState(fields["state"]),
                        load=WorkerLoad(**json.loads(fields["load"])),
                        registered_unix_ns=int(fields.get("registered_unix_ns", 0)),
                    )
                )
            except (KeyError, ValueError, TypeError) as exc:
                log.warning("redis_worker_unreadable", key=_text(key), error=str(exc))
        return workers

    async def load_prefix_index(self, worker_ids: Iterable[str]) -> dict[int, set[str]]:
        """Read the prefix sets, keeping only members in ``worker_ids``."""
        known = set(worker_ids)
        index: dict[int, set[str]] = {}
        if not known:
            return index
        head = len(self.keys.prefix_pattern()) - 1
        keys = [k async for k in self._client.scan_iter(self.keys.prefix_pattern(), _SCAN_COUNT)]
        for start in range(0, len(keys), _SCAN_COUNT):
            chunk = keys[start : start + _SCAN_COUNT]
            pipe = self._client.pipeline(transaction=False)
            for key in chunk:
                pipe.smembers(key)
            for key, members in zip(chunk, await pipe.execute(), strict=True):
                try:
                    block_hash = int(_text(key)[head:])
                except ValueError:
                    continue
                holders = {_text(m) for m in members} & known
                if holders:
                    index[block_hash] = holders
        return index


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

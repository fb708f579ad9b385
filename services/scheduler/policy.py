"""Admission and placement: a pure function from a cluster snapshot and a request to a choice.

``place(snapshot, request)`` returns a ``Placement`` or a ``Rejection``; it reads nothing but
its arguments and changes nothing, so it is tested without a loop, Redis or gRPC.

Admission, in order (the first failing check decides the rejection):

1. some registered worker serves the model, or none is          else UNKNOWN_MODEL
   registered yet (a scheduler restarted cold cannot tell)
2. a live, SERVING, non-excluded decode-capable worker exists    else NO_LIVE_WORKER
3. active sequences across those workers < ``max_inflight``      else INFLIGHT_CAP
4. prompt + max_tokens fits one of them (context and KV pool)    else NEVER_FITS
5. one of them has room now (free KV blocks, sequence slots)     else CAPACITY
6. for a disaggregated placement: a compatible prefill worker
   has room (prompt backlog, sequence slots)                     else CAPACITY

Choice:

* decode: among workers with room, fewest active sequences, then most free KV blocks;
* prefill: among live prefill workers sharing a transport with the decode worker (``shm``
  and ``cuda_ipc`` need the same host), the longest prefix-cache overlap (leading prompt
  block hashes the worker holds), then the smallest prompt backlog;
* the decode worker prefills locally when it is colocated, when the prompt is at most
  ``local_prefill_max_tokens``, or when no live prefill worker is compatible with it.

A worker is live while ``now - last_seen <= lease_ttl_s``; dead ones are ignored even before
the state loop's expiry tick removes them. Ties break on worker id, so the choice is
deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from services.scheduler.model import (
    Placement,
    PlaceRequest,
    PrefillMode,
    Rejection,
    RejectReason,
    Role,
    WorkerState,
    WorkerView,
    blocks_for,
)

HOST_LOCAL_TRANSPORTS = frozenset({"shm", "cuda_ipc"})
"""Transports that only work between two workers on the same host."""


@dataclass(frozen=True)
class AdmissionLimits:
    """Caps that keep every queue bounded; see the module docstring for where each applies.

    ``max_inflight``: active sequences (running + waiting + placed since the last heartbeat)
    summed over live decode-capable workers. ``max_waiting_per_worker``: sequences a worker
    may hold beyond its ``max_num_seqs``. ``max_queued_prompt_tokens``: a prefill worker's
    prompt backlog after accepting the request (an idle worker always takes one prompt).
    ``local_prefill_max_tokens``: prompts this short are prefilled on the decode worker
    (0: never). ``retry_after_ms``: the hint attached to capacity rejections.
    """

    max_inflight: int = 4096
    max_waiting_per_worker: int = 64
    max_queued_prompt_tokens: int = 65536
    local_prefill_max_tokens: int = 0
    retry_after_ms: int = 100


@dataclass(frozen=True)
class ClusterSnapshot:
    """The state placement decides on: registered workers, the prefix index, the clock.

    ``prefix_index`` maps a block hash to the ids of the workers known to cache that block.
    It must not change while ``place`` runs (the state loop guarantees that by calling
    ``place`` synchronously).
    """

    workers: tuple[WorkerView, ...]
    prefix_index: Mapping[int, AbstractSet[str]]
    now: float
    lease_ttl_s: float
    limits: AdmissionLimits = AdmissionLimits()


def is_live(worker: WorkerView, now: float, lease_ttl_s: float) -> bool:
    """Whether the worker's lease still holds at ``now`` (same clock as ``last_seen``)."""
    return now - worker.last_seen <= lease_ttl_s


def prefix_overlaps(
    workers: Iterable[WorkerView],
    req: PlaceRequest,
    prefix_index: Mapping[int, AbstractSet[str]],
) -> dict[str, int]:
    """Return, per worker id, how many leading prompt blocks the worker caches.

    Hashes only count for workers whose block size equals ``req.hash_block_size``; the walk
    stops at the first block no remaining candidate holds.
    """
    overlaps = {w.worker_id: 0 for w in workers}
    if not req.prompt_block_hashes or req.hash_block_size <= 0:
        return overlaps
    matching = {w.worker_id for w in workers if w.info.capacity.block_size == req.hash_block_size}
    for depth, block_hash in enumerate(req.prompt_block_hashes, start=1):
        matching &= prefix_index.get(block_hash, frozenset())
        if not matching:
            break
        for worker_id in matching:
            overlaps[worker_id] = depth
    return overlaps


def transports_compatible(prefill: WorkerView, decode: WorkerView) -> bool:
    """Whether the pair shares a KV transport usable between their hosts.

    Two workers that advertise no transports at all are taken as compatible (nothing to
    check); one that advertises none is not compatible with one that does.
    """
    p, d = prefill.info, decode.info
    if not p.transports and not d.transports:
        return True
    same_host = bool(p.host_id) and p.host_id == d.host_id
    return any(
        t in p.transports and (same_host or t not in HOST_LOCAL_TRANSPORTS) for t in d.transports
    )


def decode_blocks_needed(worker: WorkerView, req: PlaceRequest) -> int:
    """KV blocks the request may occupy on ``worker`` (prompt + max_tokens)."""
    return blocks_for(req.total_tokens, worker.info.capacity.block_size)


def _ever_fits_decode(worker: WorkerView, req: PlaceRequest) -> bool:
    cap = worker.info.capacity
    return (
        req.total_tokens <= cap.max_model_len
        and decode_blocks_needed(worker, req) <= cap.total_kv_blocks
    )


def _seq_room(worker: WorkerView, limits: AdmissionLimits) -> bool:
    return (
        worker.active_sequences < worker.info.capacity.max_num_seqs + limits.max_waiting_per_worker
    )


def has_decode_room(worker: WorkerView, req: PlaceRequest, limits: AdmissionLimits) -> bool:
    """Whether ``worker`` can take the request now as its decode worker."""
    return (
        _ever_fits_decode(worker, req)
        and decode_blocks_needed(worker, req) <= worker.free_kv_blocks
        and _seq_room(worker, limits)
    )


def has_prefill_room(worker: WorkerView, req: PlaceRequest, limits: AdmissionLimits) -> bool:
    """Whether ``worker`` can take the request's prompt now as its prefill worker."""
    backlog = worker.queued_prompt_tokens
    return (
        req.prompt_tokens <= worker.info.capacity.max_model_len
        and (backlog == 0 or backlog + req.prompt_tokens <= limits.max_queued_prompt_tokens)
        and _seq_room(worker, limits)
    )


def _decode_rank(worker: WorkerView) -> tuple[int, int, str]:
    return (worker.active_sequences, -worker.free_kv_blocks, worker.worker_id)


def _prefill_rank(worker: WorkerView, overlap: int) -> tuple[int, int, int, str]:
    return (-overlap, worker.queued_prompt_tokens, worker.active_sequences, worker.worker_id)


def place(snapshot: ClusterSnapshot, req: PlaceRequest) -> Placement | Rejection:
    """Admit ``req`` and choose its workers, or say why not (module docstring has the rules).

    Pure: the result depends only on the arguments.
    """
    limits = snapshot.limits

    def reject(reason: RejectReason, message: str, retry: bool = True) -> Rejection:
        return Rejection(reason, message, limits.retry_after_ms if retry else 0)

    serving_model = [w for w in snapshot.workers if req.model in ("", w.info.model)]
    if not serving_model and snapshot.workers:
        return reject(RejectReason.UNKNOWN_MODEL, f"no worker serves model {req.model!r}", False)

    usable = [
        w
        for w in serving_model
        if is_live(w, snapshot.now, snapshot.lease_ttl_s)
        and w.state is WorkerState.SERVING
        and w.worker_id not in req.exclude_worker_ids
    ]
    decoders = [w for w in usable if w.info.role.decodes]
    if not decoders:
        return reject(
            RejectReason.NO_LIVE_WORKER,
            "no live decode-capable worker (dead, draining or excluded)",
        )

    inflight = sum(w.active_sequences for w in decoders)
    if inflight >= limits.max_inflight:
        return reject(
            RejectReason.INFLIGHT_CAP, f"{inflight} requests in flight (cap {limits.max_inflight})"
        )

    if not any(_ever_fits_decode(w, req) for w in decoders):
        return reject(
            RejectReason.NEVER_FITS,
            f"prompt_tokens + max_tokens = {req.total_tokens} exceeds the context or KV pool "
            "of every decode worker",
            retry=False,
        )

    with_room = sorted((w for w in decoders if has_decode_room(w, req, limits)), key=_decode_rank)
    if not with_room:
        return reject(RejectReason.CAPACITY, "no decode worker has free KV blocks or slots")

    prefillers = [
        w
        for w in usable
        if w.info.role is Role.PREFILL and req.prompt_tokens <= w.info.capacity.max_model_len
    ]
    overlaps = prefix_overlaps(usable, req, snapshot.prefix_index)

    def cached_tokens(worker: WorkerView) -> int:
        return min(overlaps.get(worker.worker_id, 0) * req.hash_block_size, req.prompt_tokens)

    def local(decode: WorkerView, mode: PrefillMode) -> Placement:
        return Placement(
            request_id=req.request_id,
            attempt=req.attempt,
            decode=decode.info,
            prefill=None,
            mode=mode,
            expected_cached_tokens=cached_tokens(decode),
            decode_kv_blocks=decode_blocks_needed(decode, req),
        )

    short_prompt = req.prompt_tokens <= limits.local_prefill_max_tokens
    for decode in with_room:
        if decode.info.role is Role.COLOCATED:
            return local(decode, PrefillMode.LOCAL_COLOCATED)
        if short_prompt:
            return local(decode, PrefillMode.LOCAL_SHORT_PROMPT)
        compatible = [p for p in prefillers if transports_compatible(p, decode)]
        if not compatible:
            return local(decode, PrefillMode.LOCAL_FALLBACK)
        ready = [p for p in compatible if has_prefill_room(p, req, limits)]
        if ready:
            prefill = min(ready, key=lambda p: _prefill_rank(p, overlaps[p.worker_id]))
            return Placement(
                request_id=req.request_id,
                attempt=req.attempt,
                decode=decode.info,
                prefill=prefill.info,
                mode=PrefillMode.DISAGGREGATED,
                expected_cached_tokens=cached_tokens(prefill),
                decode_kv_blocks=decode_blocks_needed(decode, req),
            )
    return reject(RejectReason.CAPACITY, "every compatible prefill worker's queue is full")

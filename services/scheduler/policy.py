"""Admission and placement: a pure function from a cluster snapshot and a request to a choice.

``place(snapshot, request)`` returns a ``Placement`` or a ``Rejection``; it reads nothing but
its arguments and changes nothing, so it is tested without a loop, Redis or gRPC.

Admission, in order (the first failing check decides the rejection):

1. some registered worker serves the model, or none is          else UNKNOWN_MODEL
   registered yet (a scheduler restarted cold cannot tell)
2. a live, SERVING, non-excluded decode-capable worker exists    else NO_LIVE_WORKER
3. active sequences across those workers < ``max_inflight``      else INFLIGHT_CAP
4. prompt + max_tokens fits one of them (context and KV pool)    else NEVER_FITS
5. one of them has room now (free KV blocks, sequence slots      else CAPACITY
   by its batch target)
6. for a disaggregated placement: a compatible prefill worker
   has room (prompt backlog, sequence slots)                     else CAPACITY

Batch target. A decode-capable worker reports in each heartbeat the sequences its running
batch takes now: the largest batch whose decode step it predicts within its ITL target
(``engine/step_budget.py``), at most its ``max_num_seqs`` (which it is, without a target).
Its sequence slots (rule 5) are that batch target plus ``max_waiting_per_worker``: the
allowance covers the heartbeat's lag (a finished request stays counted until the next
one), and the worker checks exactly: it refuses a reservation for a remote prefill
beyond its target (RESOURCE_EXHAUSTED), and queues a prompt it prefills itself until its
batch has room.
``fleet_target_batch``: the batch targets of the live, serving decode-capable workers of
the model, summed (excluded workers too: they are the fleet still), sent with every
placement; a gateway sizes its concurrency by it, so the excess waits in its queue rather
than here or on a worker.

Cached tokens. ``cached(w)`` is the prompt's longest prefix of full blocks that worker ``w``
holds in its prefix cache, by the index its KV events feed (block hash → workers), capped
at prompt - 1 (the last token is always computed, for its logits). ``loadable(w)``: the
tokens beyond those that ``w``'s KV store holds (the leading blocks its workers confirmed
there lately: ``store_index``), which ``w`` would load instead of computing.
``uncached(w)`` = prompt - ``cached(w)`` - ``loadable(w)``: the tokens ``w`` would compute.
The store index trusts a confirmation until a worker reports the block missing; a local
prefill it chose on a stale entry is checked where it lands (below).

Choice, by ``Routing`` (``--routing``; every order ends with the worker id, so the choice is
deterministic):

* ``cache-aware`` (default), the cost of Dynamo's KV router in tokens and blocks:
  - prefill: the smallest ``uncached(p) + queued_prompt_tokens(p)``: the prompt tokens the
    worker must compute before this prompt's KV is complete (its backlog, then the part of
    this prompt it neither holds nor loads), plus ``loadable(p)`` at
    ``STORE_LOAD_TOKEN_COST`` a token; ties: fewer active sequences, then worker id;
  - decode: among the workers running at most ``DECODE_CACHE_SLACK`` sequences more than
    the least busy one, the one holding the longest prefix of the prompt (a conversation's
    earlier turns: its KV need not be moved, and the new turn may be prefilled in place);
    ties, and the busier workers after them: fewer active sequences, more free blocks,
    worker id;
  - conditional disaggregation: the decode worker prefills locally when ``uncached(d) <=
    local_prefill_max_tokens`` and the uncached prompt tokens it was given and has not yet
    computed stay within that limit (a short suffix costs running streams about one step;
    ``pdserve plan`` prints the limit that keeps one such step within an ITL SLO). The
    placement carries the limit and a fallback prefill worker (chosen as for a
    disaggregated placement, when one has room): the decode worker checks the suffix where
    it lands (its own cache, its store's lookup) and sends a longer one to the fallback.
* ``least-loaded``: prefill: the smallest backlog, then fewer active sequences; decode:
  fewer active sequences, then more free blocks. No cache in the choice; a prompt of at most
  ``local_prefill_max_tokens`` tokens is prefilled locally.
* ``round-robin``: the next worker in id order after the previous placement's (per role),
  skipping those without room; the same local rule as least-loaded.

The decode worker prefills locally also when it is colocated, or when no live prefill
worker is compatible with it (shares no transport: ``shm`` and ``cuda_ipc`` need the same
host).

A worker is live while ``now - last_seen <= lease_ttl_s``; dead ones are ignored even before
the state loop's expiry tick removes them, and so is their part of the prefix index.
"""

from __future__ import annotations

import dataclasses
import math
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
    Routing,
    WorkerState,
    WorkerView,
    blocks_for,
)
from services.scheduler.store_index import StoreIndex

HOST_LOCAL_TRANSPORTS = frozenset({"shm", "cuda_ipc"})
"""Transports that only work between two workers on the same host."""

DECODE_CACHE_SLACK = 2
"""Cache-aware decode choice: a worker holding more of the prompt (a conversation's earlier
turns) is preferred while it runs at most this many sequences more than the least busy
one. One more sequence adds a few percent to every step of that worker; a worker that holds
the conversation receives fewer KV bytes and may prefill the new turn itself."""

STORE_LOAD_TOKEN_COST = 0.01
"""A prompt token loaded from the KV store costs this fraction of one computed. Measured on
one core (docs/benchmarks.md, "KV store"): 1 block loads in 2.1 ms and computes in 69 ms
(1/33), 4,096 tokens in 52 ms against 17.5 s (1/340); a hundredth sits between them."""

LOCAL_PREFILL_MAX_TOKENS = 32
"""The default local-prefill limit: on this project's reference machine (docs/benchmarks.md,
"Sizing") 32 uncached tokens prefill in ~0.13 s on one core, so a decode step at batch 1
(~0.06 s) that also computes them stays within a 0.2 s ITL SLO (``pdserve plan`` prints the
limit for a measured profile and SLO)."""


@dataclass(frozen=True)
class AdmissionLimits:
    """Caps that keep every queue bounded; see the module docstring for where each applies.

    ``max_inflight``: active sequences (running + waiting + placed since the last heartbeat)
    summed over live decode-capable workers. ``max_waiting_per_worker``: sequences a worker
    may hold beyond its ``max_num_seqs``. ``max_queued_prompt_tokens``: a prefill worker's
    prompt backlog after accepting the request (an idle worker always takes one prompt).
    ``local_prefill_max_tokens``: a decode worker prefills a request itself when it would
    compute at most this many of its prompt tokens (0: never; module docstring).
    ``retry_after_ms``: the hint attached to capacity rejections.
    """

    max_inflight: int = 4096
    max_waiting_per_worker: int = 64
    max_queued_prompt_tokens: int = 65536
    local_prefill_max_tokens: int = LOCAL_PREFILL_MAX_TOKENS
    retry_after_ms: int = 100


@dataclass(frozen=True)
class ClusterSnapshot:
    """The state placement decides on: registered workers, the prefix index, the clock.

    ``prefix_index`` maps a block hash to the ids of the workers known to cache that block.
    It must not change while ``place`` runs (the state loop guarantees that by calling
    ``place`` synchronously). ``last_prefill`` / ``last_decode``: the workers of the
    previous placement (round-robin continues after them). ``store_index``: likewise read
    only while ``place`` runs.
    """

    workers: tuple[WorkerView, ...]
    prefix_index: Mapping[int, AbstractSet[str]]
    now: float
    lease_ttl_s: float
    limits: AdmissionLimits = AdmissionLimits()
    routing: Routing = Routing.CACHE_AWARE
    last_prefill: str = ""
    last_decode: str = ""
    store_index: StoreIndex | None = None
    """The blocks each KV store holds (``store_index``); None: no store is known."""


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
    return worker.active_sequences < worker.batch_target + limits.max_waiting_per_worker


def fleet_target_batch(snapshot: ClusterSnapshot, model: str = "") -> int:
    """The batch targets of the live, serving decode-capable workers of ``model`` (""
    every model's), summed: the sequences the fleet runs at once within its ITL targets."""
    return sum(
        w.batch_target
        for w in snapshot.workers
        if w.info.role.decodes
        and model in ("", w.info.model)
        and w.state is WorkerState.SERVING
        and is_live(w, snapshot.now, snapshot.lease_ttl_s)
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


@dataclass(frozen=True)
class _CacheView:
    """What the prefix index and the KV stores' index say about one request, per worker.

    ``stored_runs``: per store, the leading prompt blocks it holds (``store_index``)."""

    req: PlaceRequest
    overlaps: Mapping[str, int]
    routing: Routing
    stored_runs: Mapping[str, int]

    def _tokens(self, blocks: int) -> int:
        bs = self.req.hash_block_size
        if bs <= 0:
            return 0
        return min(blocks, (self.req.prompt_tokens - 1) // bs) * bs

    def cached(self, worker: WorkerView) -> int:
        """Prompt tokens ``worker`` holds (full blocks; the last token is always computed,
        for its logits)."""
        return self._tokens(self.overlaps.get(worker.worker_id, 0))

    def loadable(self, worker: WorkerView) -> int:
        """Prompt tokens beyond ``cached`` that ``worker`` would load from its KV store."""
        stored = self._tokens(self.stored_runs.get(worker.info.kv_store, 0))
        return max(0, stored - self.cached(worker))

    def reused(self, worker: WorkerView) -> int:
        """Prompt tokens ``worker`` would not compute: its cache's, then its store's."""
        return self.cached(worker) + self.loadable(worker)

    def uncached(self, worker: WorkerView) -> int:
        """Prompt tokens ``worker`` would compute, as far as the routing looks at caches."""
        if self.routing is not Routing.CACHE_AWARE:
            return self.req.prompt_tokens
        return self.req.prompt_tokens - self.reused(worker)

    def cost(self, worker: WorkerView) -> int:
        """A prefill worker's cost in prompt tokens: what it would compute, plus what it
        would load at ``STORE_LOAD_TOKEN_COST`` of a computed token each."""
        return self.uncached(worker) + math.ceil(self.loadable(worker) * STORE_LOAD_TOKEN_COST)


def stored_runs(
    workers: Iterable[WorkerView], req: PlaceRequest, snapshot: ClusterSnapshot
) -> dict[str, int]:
    """Per KV store the ``workers`` name, the leading prompt blocks it holds."""
    index = snapshot.store_index
    if index is None or req.hash_block_size <= 0:
        return {}
    stores = {
        w.info.kv_store
        for w in workers
        if w.info.kv_store and w.info.capacity.block_size == req.hash_block_size
    }
    return {s: index.leading_run(s, req.prompt_block_hashes) for s in stores}


def _decode_order(
    workers: list[WorkerView], snapshot: ClusterSnapshot, cache: _CacheView
) -> list[WorkerView]:
    """Decode workers with room, best first (module docstring)."""
    if snapshot.routing is Routing.ROUND_ROBIN:
        return _round_robin(workers, snapshot.last_decode)
    if snapshot.routing is Routing.LEAST_LOADED:
        return sorted(workers, key=lambda w: (w.active_sequences, -w.free_kv_blocks, w.worker_id))

    # The least busy workers, and those at most DECODE_CACHE_SLACK sequences busier, are
    # ranked by how much of the prompt they hold; the rest follow, least busy first.
    fewest = min(w.active_sequences for w in workers)

    def rank(w: WorkerView) -> tuple[bool, int, int, int, str]:
        near = w.active_sequences <= fewest + DECODE_CACHE_SLACK
        return (not near, -cache.cached(w) if near else 0, w.active_sequences,
                -w.free_kv_blocks, w.worker_id)  # fmt: skip

    return sorted(workers, key=rank)


def _choose_prefill(
    ready: list[WorkerView], snapshot: ClusterSnapshot, cache: _CacheView
) -> WorkerView:
    """The prefill worker among those with room (module docstring)."""
    if snapshot.routing is Routing.ROUND_ROBIN:
        return _round_robin(ready, snapshot.last_prefill)[0]
    if snapshot.routing is Routing.LEAST_LOADED:
        return min(ready, key=lambda w: (w.queued_prompt_tokens, w.active_sequences, w.worker_id))
    return min(
        ready,
        key=lambda w: (cache.cost(w) + w.queued_prompt_tokens, w.active_sequences, w.worker_id),
    )


def _round_robin(workers: Iterable[WorkerView], last: str) -> list[WorkerView]:
    """``workers`` in id order, starting after ``last`` and wrapping around."""
    ordered = sorted(workers, key=lambda w: w.worker_id)
    after = [w for w in ordered if w.worker_id > last]
    return after + [w for w in ordered if w.worker_id <= last]


def place(snapshot: ClusterSnapshot, req: PlaceRequest) -> Placement | Rejection:
    """Admit ``req`` and choose its workers, or say why not (module docstring has the rules).

    Pure: the result depends only on the arguments. A placement carries the fleet's
    batch target (``fleet_target_batch``).
    """
    admitted = _admit(snapshot, req)
    if isinstance(admitted, Rejection):
        return admitted
    usable, decoders = admitted
    with_room = [w for w in decoders if has_decode_room(w, req, snapshot.limits)]
    if not with_room:
        return _reject(
            snapshot.limits,
            RejectReason.CAPACITY,
            "no decode worker has free KV blocks or slots within its batch target",
        )
    cache = _CacheView(
        req,
        prefix_overlaps(usable, req, snapshot.prefix_index),
        snapshot.routing,
        stored_runs(usable, req, snapshot),
    )
    result = _pair(_decode_order(with_room, snapshot, cache), usable, snapshot, req, cache)
    if isinstance(result, Rejection):
        return result
    return dataclasses.replace(result, fleet_target_batch=fleet_target_batch(snapshot, req.model))


def _reject(
    limits: AdmissionLimits, reason: RejectReason, message: str, retry: bool = True
) -> Rejection:
    return Rejection(reason, message, limits.retry_after_ms if retry else 0)


def _admit(
    snapshot: ClusterSnapshot, req: PlaceRequest
) -> tuple[list[WorkerView], list[WorkerView]] | Rejection:
    """Admission checks 1-4 (module docstring): the usable workers (live, SERVING, not
    excluded, serving the model) and the decode-capable ones among them, or the rejection."""
    limits = snapshot.limits
    serving_model = [w for w in snapshot.workers if req.model in ("", w.info.model)]
    if not serving_model and snapshot.workers:
        return _reject(
            limits, RejectReason.UNKNOWN_MODEL, f"no worker serves model {req.model!r}", retry=False
        )

    usable = [
        w
        for w in serving_model
        if is_live(w, snapshot.now, snapshot.lease_ttl_s)
        and w.state is WorkerState.SERVING
        and w.worker_id not in req.exclude_worker_ids
    ]
    decoders = [w for w in usable if w.info.role.decodes]
    if not decoders:
        reason = "no live decode-capable worker (dead, draining or excluded)"
        return _reject(limits, RejectReason.NO_LIVE_WORKER, reason)

    inflight = sum(w.active_sequences for w in decoders)
    if inflight >= limits.max_inflight:
        reason = f"{inflight} requests in flight (cap {limits.max_inflight})"
        return _reject(limits, RejectReason.INFLIGHT_CAP, reason)

    if not any(_ever_fits_decode(w, req) for w in decoders):
        return _reject(
            limits,
            RejectReason.NEVER_FITS,
            f"prompt_tokens + max_tokens = {req.total_tokens} exceeds the context or KV pool "
            "of every decode worker",
            retry=False,
        )
    return usable, decoders


def _pair(
    decoders: list[WorkerView],
    usable: list[WorkerView],
    snapshot: ClusterSnapshot,
    req: PlaceRequest,
    cache: _CacheView,
) -> Placement | Rejection:
    """The first of ``decoders`` (with room, best first) that prefills the prompt itself
    or has a compatible prefill worker with room (admission check 6, module docstring)."""
    limits = snapshot.limits
    prefillers = [
        w
        for w in usable
        if w.info.role is Role.PREFILL and req.prompt_tokens <= w.info.capacity.max_model_len
    ]
    limit = limits.local_prefill_max_tokens
    for decode in decoders:
        if decode.info.role is Role.COLOCATED:
            return _placement(req, cache, decode, PrefillMode.LOCAL_COLOCATED)
        suffix = cache.uncached(decode)
        compatible = [p for p in prefillers if transports_compatible(p, decode)]
        ready = [p for p in compatible if has_prefill_room(p, req, limits)]
        if suffix <= limit and decode.queued_prompt_tokens + suffix <= limit:
            fallback = _choose_prefill(ready, snapshot, cache) if ready else None
            return _placement(
                req, cache, decode, PrefillMode.LOCAL_SHORT_PROMPT, fallback, local_limit=limit
            )
        if not compatible:
            return _placement(req, cache, decode, PrefillMode.LOCAL_FALLBACK)
        if ready:
            prefill = _choose_prefill(ready, snapshot, cache)
            return _placement(req, cache, decode, PrefillMode.DISAGGREGATED, prefill)
    return _reject(limits, RejectReason.CAPACITY, "every compatible prefill worker's queue is full")


def _placement(
    req: PlaceRequest,
    cache: _CacheView,
    decode: WorkerView,
    mode: PrefillMode,
    prefill: WorkerView | None = None,
    *,
    local_limit: int = 0,
) -> Placement:
    """``req`` on ``decode``, prefilled by ``prefill`` when ``mode`` is DISAGGREGATED, else
    by ``decode`` itself (``prefill``: the fallback past ``local_limit`` uncached tokens)."""
    computes = prefill if mode is PrefillMode.DISAGGREGATED and prefill is not None else decode
    return Placement(
        request_id=req.request_id,
        attempt=req.attempt,
        decode=decode.info,
        prefill=prefill.info if prefill is not None else None,
        mode=mode,
        expected_cached_tokens=cache.reused(computes),
        decode_kv_blocks=decode_blocks_needed(decode, req),
        local_prefill_max_tokens=local_limit,
    )

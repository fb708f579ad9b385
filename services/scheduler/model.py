"""The scheduler's messages and records: typed, frozen, free of protobuf and I/O.

``server.py`` converts the wire messages into these; ``policy.py`` and ``state.py`` only ever
see these types.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Role(enum.Enum):
    """What a worker does (``pdserve.v1.WorkerRole`` without UNSPECIFIED)."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"

    @property
    def decodes(self) -> bool:
        """Whether the worker can receive a request and stream its tokens."""
        return self is not Role.PREFILL


class WorkerState(enum.Enum):
    """What a worker is willing to do.

    SERVING and DRAINING are what heartbeats report (``pdserve.v1.WorkerState``); REGISTERED
    is the scheduler's own state between registration and the first heartbeat, in which the
    worker gets no placements.
    """

    REGISTERED = "registered"
    SERVING = "serving"
    DRAINING = "draining"


class PrefillMode(enum.Enum):
    """Who computes the prompt of a placed request."""

    DISAGGREGATED = "disaggregated"
    """A prefill worker computes it and writes the KV into the decode worker."""
    LOCAL_COLOCATED = "local_colocated"
    """The chosen worker is colocated: it always prefills its own prompts."""
    LOCAL_SHORT_PROMPT = "local_short_prompt"
    """What the decode worker must compute of the prompt (all of it, unless routing is
    cache-aware and the worker holds a prefix) is short enough to compute in place."""
    LOCAL_FALLBACK = "local_fallback"
    """No live prefill worker can serve this decode worker, so the decode worker prefills."""


class Routing(enum.Enum):
    """How placement chooses among workers with room (``policy.py`` has the rules)."""

    CACHE_AWARE = "cache-aware"
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


class RejectReason(enum.Enum):
    """Why a request was not placed; ``server.py`` maps each to a gRPC status."""

    UNKNOWN_MODEL = "unknown_model"
    """No registered worker serves the model (NOT_FOUND)."""
    NO_LIVE_WORKER = "no_live_worker"
    """No live, serving, non-excluded decode-capable worker (UNAVAILABLE)."""
    NEVER_FITS = "never_fits"
    """prompt + max_tokens exceeds every candidate's context or KV pool (INVALID_ARGUMENT)."""
    CAPACITY = "capacity"
    """Workers exist but none has room now (RESOURCE_EXHAUSTED)."""
    INFLIGHT_CAP = "inflight_cap"
    """The global in-flight cap is reached (RESOURCE_EXHAUSTED)."""
    OVERLOADED = "overloaded"
    """The scheduler's own command queue is full (RESOURCE_EXHAUSTED)."""


class FinishReason(enum.Enum):
    """How a placed request ended (``pdserve.v1.FinishReason`` without UNSPECIFIED)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class WorkerCapacity:
    """A worker's fixed limits; every field is > 0."""

    total_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int


@dataclass(frozen=True)
class WorkerInfo:
    """Identity, address and capacity of one worker process incarnation."""

    worker_id: str
    role: Role
    grpc_address: str
    capacity: WorkerCapacity
    model: str = ""
    metrics_address: str = ""
    transports: tuple[str, ...] = ()
    host_id: str = ""
    started_unix_ns: int = 0
    version: str = ""
    kv_region_digest: str = ""
    """Decode workers: the identity of their registered KV region (placement tokens name it)."""
    kv_store: str = ""
    """host:port of the KV store's master the worker loads prefixes from ("" none)."""


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load at one instant, as it reported it in a heartbeat."""

    running_requests: int = 0
    waiting_requests: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    queued_prompt_tokens: int = 0
    target_batch: int = 0
    """Sequences its running batch takes now within its ITL target; 0: not reported."""


@dataclass(frozen=True)
class Reservation:
    """Load the scheduler attributed to one worker for one placement.

    Held until the request's outcome, or until a heartbeat sent at least half a heartbeat
    interval after the placement (whose load then includes the request), whichever is first.
    """

    kv_blocks: int = 0
    sequences: int = 0
    prompt_tokens: int = 0


@dataclass(frozen=True)
class WorkerView:
    """Everything placement knows about one registered worker at one instant.

    ``last_seen`` is the scheduler's monotonic clock at the last registration or heartbeat.
    The ``pending_*`` fields sum the reservations made since the worker last reported its
    load (``Reservation``), so back-to-back placements see each other.
    """

    info: WorkerInfo
    state: WorkerState
    load: WorkerLoad
    last_seen: float
    pending_kv_blocks: int = 0
    pending_sequences: int = 0
    pending_prompt_tokens: int = 0

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def free_kv_blocks(self) -> int:
        """Free blocks after the reservations not yet reflected in a heartbeat."""
        return self.load.free_kv_blocks - self.pending_kv_blocks

    @property
    def batch_target(self) -> int:
        """The sequences it runs at once now: its reported target batch, at most (and when
        it reports none, exactly) its ``max_num_seqs``."""
        most = self.info.capacity.max_num_seqs
        target = self.load.target_batch
        return min(most, target) if target > 0 else most

    @property
    def active_sequences(self) -> int:
        """Running + waiting sequences, including the ones placed since the last heartbeat."""
        return self.load.running_requests + self.load.waiting_requests + self.pending_sequences

    @property
    def queued_prompt_tokens(self) -> int:
        """Prompt backlog, including prompts placed since the last heartbeat."""
        return self.load.queued_prompt_tokens + self.pending_prompt_tokens


@dataclass(frozen=True)
class PlaceRequest:
    """A request to admit and place, described by what placement needs.

    ``prompt_block_hashes`` are the chained hashes of the prompt's full blocks
    (``engine/block_hash.py``) computed with ``hash_block_size`` tokens per block.
    """

    request_id: str
    prompt_tokens: int
    max_tokens: int
    model: str = ""
    attempt: int = 0
    exclude_worker_ids: frozenset[str] = frozenset()
    prompt_block_hashes: tuple[int, ...] = ()
    hash_block_size: int = 0

    @property
    def total_tokens(self) -> int:
        """The most tokens the request's sequence can hold: its KV budget."""
        return self.prompt_tokens + self.max_tokens


@dataclass(frozen=True)
class Placement:
    """Where a request runs. ``prefill`` computes the prompt when ``mode`` is DISAGGREGATED.
    With ``local_prefill_max_tokens`` (LOCAL_SHORT_PROMPT) the decode worker prefills only
    if at most that many tokens remain uncached where it lands; else ``prefill`` (a
    fallback; None: none had room) does."""

    request_id: str
    attempt: int
    decode: WorkerInfo
    prefill: WorkerInfo | None
    mode: PrefillMode
    expected_cached_tokens: int = 0
    decode_kv_blocks: int = 0
    """KV blocks the placement reserved on the decode worker."""
    local_prefill_max_tokens: int = 0
    fleet_target_batch: int = 0
    """Sequences the fleet runs at once within its ITL targets now (``policy``)."""


@dataclass(frozen=True)
class Rejection:
    """Why a request was not placed, and when retrying may help (``retry_after_ms``)."""

    reason: RejectReason
    message: str
    retry_after_ms: int = 0


@dataclass(frozen=True)
class Outcome:
    """How a placed request ended, as the gateway reports it."""

    request_id: str
    finish_reason: FinishReason
    attempt: int = 0
    prefill_worker_id: str = ""
    decode_worker_id: str = ""
    error_code: int = 0
    error_message: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    arrival_unix_ns: int = 0
    first_token_unix_ns: int = 0
    finish_unix_ns: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0


@dataclass(frozen=True)
class HeartbeatReport:
    """One worker heartbeat: lease renewal, load, and prefix-cache changes."""

    worker_id: str
    state: WorkerState
    sequence: int
    load: WorkerLoad
    cached_added: tuple[int, ...] = ()
    cached_removed: tuple[int, ...] = ()
    cache_snapshot: bool = False
    stored: tuple[int, ...] = ()  # block hashes confirmed in the worker's KV store
    store_missing: tuple[int, ...] = ()  # block hashes a lookup found missing there


@dataclass(frozen=True)
class HeartbeatAnswer:
    """The scheduler's reply to a heartbeat."""

    resync_cache: bool
    heartbeat_interval_ms: int


@dataclass(frozen=True)
class Lease:
    """The lease terms a registered worker must keep."""

    heartbeat_interval_ms: int
    lease_ttl_ms: int


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks needed to hold ``tokens`` tokens (ceiling division)."""
    return -(-tokens // block_size)

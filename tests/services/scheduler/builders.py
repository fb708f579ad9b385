"""Small constructors for the scheduler's dataclasses, with defaults tests rarely change."""

from __future__ import annotations

from services.scheduler.model import (
    PlaceRequest,
    Role,
    WorkerCapacity,
    WorkerInfo,
    WorkerLoad,
    WorkerState,
    WorkerView,
)
from services.scheduler.policy import AdmissionLimits, ClusterSnapshot
from services.scheduler.store_index import StoreIndex

BLOCK = 16
NOW = 1000.0
TTL = 1.0


def capacity(
    blocks: int = 1000, block_size: int = BLOCK, seqs: int = 8, model_len: int = 4096
) -> WorkerCapacity:
    return WorkerCapacity(
        total_kv_blocks=blocks,
        block_size=block_size,
        max_num_seqs=seqs,
        max_model_len=model_len,
        max_num_batched_tokens=2048,
    )


def info(
    worker_id: str,
    role: Role,
    *,
    cap: WorkerCapacity | None = None,
    model: str = "m",
    transports: tuple[str, ...] = ("tcp",),
    host_id: str = "h1",
    kv_store: str = "",
) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        role=role,
        grpc_address=f"{worker_id}:1",
        capacity=cap or capacity(),
        model=model,
        transports=transports,
        host_id=host_id,
        kv_store=kv_store,
    )


def view(
    worker_id: str,
    role: Role = Role.DECODE,
    *,
    free: int | None = None,
    running: int = 0,
    waiting: int = 0,
    queued_tokens: int = 0,
    age: float = 0.0,
    state: WorkerState = WorkerState.SERVING,
    cap: WorkerCapacity | None = None,
    model: str = "m",
    transports: tuple[str, ...] = ("tcp",),
    host_id: str = "h1",
    pending_blocks: int = 0,
    pending_seqs: int = 0,
    kv_store: str = "",
    target_batch: int = 0,
) -> WorkerView:
    """A worker whose last heartbeat was ``age`` seconds before ``NOW``."""
    cap = cap or capacity()
    return WorkerView(
        info=info(
            worker_id,
            role,
            cap=cap,
            model=model,
            transports=transports,
            host_id=host_id,
            kv_store=kv_store,
        ),
        state=state,
        load=WorkerLoad(
            running_requests=running,
            waiting_requests=waiting,
            free_kv_blocks=cap.total_kv_blocks if free is None else free,
            total_kv_blocks=cap.total_kv_blocks,
            queued_prompt_tokens=queued_tokens,
            target_batch=target_batch,
        ),
        last_seen=NOW - age,
        pending_kv_blocks=pending_blocks,
        pending_sequences=pending_seqs,
    )


def snapshot(
    *workers: WorkerView,
    index: dict[int, set[str]] | None = None,
    limits: AdmissionLimits | None = None,
    store_index: StoreIndex | None = None,
) -> ClusterSnapshot:
    return ClusterSnapshot(
        workers=workers,
        prefix_index=index or {},
        now=NOW,
        lease_ttl_s=TTL,
        limits=limits or AdmissionLimits(),
        store_index=store_index,
    )


def request(
    request_id: str = "r1",
    *,
    prompt: int = 100,
    max_tokens: int = 28,
    hashes: tuple[int, ...] = (),
    hash_block_size: int = BLOCK,
    exclude: frozenset[str] = frozenset(),
    model: str = "",
    attempt: int = 0,
) -> PlaceRequest:
    return PlaceRequest(
        request_id=request_id,
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        model=model,
        attempt=attempt,
        exclude_worker_ids=exclude,
        prompt_block_hashes=hashes,
        hash_block_size=hash_block_size,
    )

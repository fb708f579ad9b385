"""Warm an engine's prefix cache from the KV store before a prompt is planned.

``loaded_prefix(aengine, store, token_ids)`` is an async context manager: on entry, the
leading full blocks of ``token_ids`` that the engine lacks and the store holds are loaded
into blocks of its pool and enter its prefix cache, so whatever next claims that prefix (an
admitted prompt, a colocated request, a reservation) finds them as an ordinary prefix hit and
computes only the rest; on exit the hold on those blocks is dropped (they stay cached).

Stages: hashes and the local hit (engine thread) -> the store's run (loader thread) ->
blocks claimed (engine thread) -> read and checked into them (loader thread) -> committed
(engine thread). Every stage may come up short -- the store lacks the blocks, the pool is
full, the store is down, the deadline passes -- and then fewer blocks (or none) are
loaded and the engine computes the rest: the result is the same, only slower. A load
that outlives its deadline keeps its claimed blocks until its thread stops writing them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass

import structlog

from engine.async_engine import AsyncEngine
from engine.errors import ResourceExhaustedError
from kvstore.store import KVStore

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class PrefixLoad:
    """What a ``loaded_prefix`` did: ``blocks`` loaded (0: none) in ``seconds``."""

    blocks: int = 0
    tokens: int = 0
    seconds: float = 0.0


@asynccontextmanager
async def loaded_prefix(
    aengine: AsyncEngine,
    store: KVStore | None,
    token_ids: Sequence[int],
    *,
    timeout_s: float,
    min_blocks: int = 1,
) -> AsyncIterator[PrefixLoad]:
    """Load the prefix blocks of ``token_ids`` the engine lacks and ``store`` holds (at
    least ``min_blocks`` of them, else none); yields what was loaded. Never raises for the
    store's sake: a failed load loads less."""
    if store is None:
        yield PrefixLoad()
        return
    eng = aengine.engine
    claimed: tuple[int, ...] = ()
    t0 = time.monotonic()
    try:
        loaded, claimed = await _load(aengine, store, token_ids, timeout_s, min_blocks)
    except Exception:
        log.warning("kv_store_load_failed", exc_info=True)
        loaded = 0
    result = PrefixLoad(loaded, loaded * eng.kv_spec.block_size, time.monotonic() - t0)
    try:
        yield result
    finally:
        if claimed:
            held = claimed
            aengine.submit(lambda: eng.free_blocks(held))


async def uncached_tokens(
    aengine: AsyncEngine, store: KVStore | None, token_ids: Sequence[int], *, timeout_s: float
) -> int:
    """How many of ``token_ids`` a prefill here would compute: those neither in the
    engine's prefix cache nor in the leading run the store holds now (a lookup on a loader
    thread; a failed or late one finds nothing). The last token always counts."""
    eng = aengine.engine
    ids = list(token_ids)
    cached, hashes = await aengine.call(lambda: eng.prefix_hashes(ids))
    reused = cached
    if store is not None and cached < len(hashes):
        deadline = time.monotonic() + timeout_s
        present = await _on_loader(store, deadline, store.present_run, hashes[cached:])
        reused += present or 0
    return len(ids) - reused * eng.kv_spec.block_size


async def _load(
    aengine: AsyncEngine,
    store: KVStore,
    token_ids: Sequence[int],
    timeout_s: float,
    min_blocks: int,
) -> tuple[int, tuple[int, ...]]:
    """(blocks loaded and committed, blocks claimed: the caller frees them). Whatever ends
    it early (a failure, the deadline, a cancellation: the caller went away) frees the
    blocks it claimed itself, once nothing writes them any more."""
    eng = aengine.engine
    ids = list(token_ids)
    deadline = time.monotonic() + timeout_s
    cached, hashes = await aengine.call(lambda: eng.prefix_hashes(ids))
    wanted = hashes[cached:]
    if len(wanted) < min_blocks:
        return 0, ()
    present = await _on_loader(store, deadline, store.present_run, wanted)
    if present is None or present < min_blocks:
        return 0, ()
    wanted = wanted[:present]

    def free_later(blocks: Future[tuple[int, ...]] | tuple[int, ...]) -> None:
        if isinstance(blocks, tuple):
            aengine.submit(lambda: eng.free_blocks(blocks))
        elif not blocks.cancelled() and blocks.exception() is None:
            free_later(blocks.result())

    claiming: Future[tuple[int, ...]] = aengine.submit(lambda: eng.claim_blocks(len(wanted)))
    try:
        claimed = await asyncio.wrap_future(claiming)
    except ResourceExhaustedError:
        return 0, ()  # the pool is full now: computing will wait for blocks anyway
    except BaseException:
        # Cancelled while the engine thread claims: free what it claimed, when it has.
        claiming.add_done_callback(free_later)
        raise
    loading = store.submit(store.load, eng.kv, wanted, claimed)
    try:
        loaded = await asyncio.wait_for(asyncio.wrap_future(loading), deadline - time.monotonic())
        if loaded:
            await aengine.call(lambda: eng.commit_loaded(claimed[:loaded], wanted[:loaded]))
    except BaseException:
        # The loader may still be writing into the claimed blocks: free them once it
        # stopped (committed or not, they are then only cache).
        loading.add_done_callback(lambda _: free_later(claimed))
        raise
    return loaded, claimed


async def _on_loader(store: KVStore, deadline: float, fn: object, *args: object) -> int | None:
    """``fn(*args)`` on a loader thread by ``deadline``; None when it fails or is late."""
    future = store.submit(fn, *args)
    try:
        return int(await asyncio.wait_for(asyncio.wrap_future(future), deadline - time.monotonic()))
    except (TimeoutError, Exception) as e:
        log.warning("kv_store_lookup_failed", error=repr(e))
        return None

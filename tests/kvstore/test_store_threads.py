"""What the KV store costs the engine that feeds it, on a real ``mooncake_master``.

The engine thread only queues and holds the blocks it exports (``export_to``): the store's
copier copies them and drops the holds through the engine's command queue. Every thread of
the store, and every thread the store client starts, runs on the cores it was given
(``cpus``; ``pinned_call``), so a decode worker keeps all of it off its engine's core. A
lookup that finds less than it asked for reports the first missing block.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.kv_cache import KVCache, KVCacheSpec
from engine.sampling_params import SamplingParams
from engine.threads import pinned_call
from kvstore.backend import MooncakeBackend, MooncakeOptions
from kvstore.block_format import BlockFormat
from kvstore.master_process import MooncakeMaster
from kvstore.store import KVStore, export_to

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SPEC = KVCacheSpec(num_layers=2, num_blocks=8, block_size=16, num_kv_heads=1, head_dim=8,
                   dtype=torch.float32)  # fmt: skip


def _backend(master: MooncakeMaster) -> MooncakeBackend:
    return MooncakeBackend(MooncakeOptions(master.address, "127.0.0.1", 16 << 20))


def _threads() -> dict[int, tuple[str, str]]:
    """This process's threads: id -> (OS name, the cores it may run on)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        task = Path("/proc/self/task") / tid
        status = (task / "status").read_text().splitlines()
        cpus = next(line.split()[1] for line in status if line.startswith("Cpus_allowed_list"))
        out[int(tid)] = ((task / "comm").read_text().strip(), cpus)
    return out


@pytest.fixture
def closing() -> Iterator[list[KVStore]]:
    stores: list[KVStore] = []
    yield stores
    for store in stores:
        store.close()


async def test_exported_blocks_are_held_until_the_copier_copied_them(
    master: MooncakeMaster, make_engine, closing: list[KVStore]
) -> None:
    engine = make_engine()
    fmt = BlockFormat.for_pool(engine.kv_spec, engine.model_digest)
    store = KVStore(_backend(master), fmt, start=False)  # the copier waits: holds show
    closing.append(store)
    aengine = AsyncEngine(engine)
    aengine.start()
    try:
        await export_to(aengine, store)
        ids = [(7 * i) % 4000 + 10 for i in range(50)]
        events = [ev async for ev in aengine.generate("r1", ids, GREEDY)]
        assert events[-1].finished
        full = (len(ids) + GREEDY.max_tokens - 1) // 16
        hashes, held = await aengine.call(
            lambda: (engine.blocks.cached_hashes(), engine.blocks.num_blocks
                     - engine.blocks.num_free_blocks)
        )  # fmt: skip
        # the request finished, yet every block it exported is still held for the copier
        assert held == full == store.stats.offered_blocks
        assert store.stats.copied_blocks == 0
        store.start()
        assert store.flush(10.0)
        await aengine.call(lambda: None)  # the copier's release, queued before this, ran
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        assert store.stats.copied_blocks == store.stats.stored_blocks == full
        # what was stored is the pool's bytes: load one block back and compare
        block_id = engine.blocks._block_of_hash[hashes[0]]
        dest = KVCache(engine.kv_spec)
        assert store.load(dest, [hashes[0]], [0]) == 1
        assert torch.equal(dest.pool[:, :, 0], engine.kv.pool[:, :, block_id])
        assert store.stats.offer_seconds_total > 0
    finally:
        await export_to(aengine, None)
        await aengine.stop()


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores to tell them apart")
def test_every_store_thread_runs_on_the_cores_given(
    master: MooncakeMaster, closing: list[KVStore]
) -> None:
    before = set(_threads())
    assert len(os.sched_getaffinity(0)) > 1  # this thread may run anywhere

    def connect() -> KVStore:
        return KVStore(_backend(master), BlockFormat.for_pool(SPEC, "00000000000000aa"),
                       cpus=frozenset({0}))  # fmt: skip

    store = pinned_call({0}, connect)
    closing.append(store)
    assert store.submit(lambda: os.sched_getaffinity(0)).result(timeout=10) == {0}
    deadline = time.monotonic() + 10.0
    while True:  # the copier and putter name themselves once they run
        new = {tid: v for tid, v in _threads().items() if tid not in before}
        names = {name for name, _ in new.values()}
        if {"kv-store-copy", "kv-store-put"} <= names or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert {"kv-store-copy", "kv-store-put"} <= names
    assert len(new) > 3  # Mooncake's own transfer threads among them
    assert {cpus for _, cpus in new.values()} == {"0"}, new


def test_a_lookup_that_ends_early_reports_the_first_missing_block(
    master: MooncakeMaster, closing: list[KVStore]
) -> None:
    fmt = BlockFormat.for_pool(SPEC, "00000000000000ab")
    store = KVStore(_backend(master), fmt)
    closing.append(store)
    source = KVCache(SPEC)
    source.pool.normal_()
    assert store.offer(source, [101, 102], [0, 1]) == [0, 1]  # the ids to hold
    assert store.flush(10.0)
    assert store.drain_missing() == []
    assert store.present_run([101, 102, 103, 104]) == 2
    assert store.drain_missing() == [103]
    assert store.present_run([101, 102]) == 2
    assert store.drain_missing() == []  # drained, and nothing new is missing
    assert store.stats.absent_blocks == 1

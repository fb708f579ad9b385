"""The KV store between engines, on a real ``mooncake_master`` and the real model.

One engine computes a prompt and its full blocks go to the store (``LLMEngine.kv_export``
-> ``KVStore.offer``); another engine, with a pool of its own, loads them
(``loaded_prefix``) and computes only the rest. The loaded bytes are the computing
engine's bytes; the tokens are the tokens of computing it all (colocated and
disaggregated); a wrong object is refused; a full write buffer drops; a dead master
loads nothing and costs no more than the deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kvstore.backend import MooncakeBackend, MooncakeOptions
from kvstore.block_format import BlockFormat
from kvstore.master_process import MooncakeMaster
from kvstore.prefix import loaded_prefix
from kvstore.store import KVStore
from tests.engine.parity import assert_greedy_equal
from tests.engine.test_disagg_roles import _copy_layer

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
BS = 16


def _prompt(tokenizer, topic: str) -> list[int]:
    text = f"Here are some notes about {topic}. " + " ".join(
        f"Note {i}: {topic} matters for reason number {i}." for i in range(12)
    )
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


@pytest.fixture
def stores(master: MooncakeMaster) -> Iterator[Callable[..., KVStore]]:
    made: list[KVStore] = []

    def make(engine: LLMEngine, **options: object) -> KVStore:
        backend = MooncakeBackend(
            MooncakeOptions(master=master.address, host="127.0.0.1", segment_bytes=64 << 20)
        )
        fmt = BlockFormat.for_pool(engine.kv_spec, engine.model_digest)
        store = KVStore(backend, fmt, **options)  # type: ignore[arg-type]
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def _export_to(engine: LLMEngine, store: KVStore) -> None:
    """The engine's blocks go to ``store`` without holds: these tests flush the store before
    the pool changes again (``export_to``, the serving path's wiring, holds them)."""

    def export(hashes, blocks) -> None:
        store.offer(engine.kv, hashes, blocks)

    engine.kv_export = export


def _block_bytes(engine: LLMEngine, block_hash: int) -> torch.Tensor:
    block_id = engine.blocks._block_of_hash[block_hash]
    return engine.kv.pool[:, :, block_id].clone()


async def test_a_prefix_one_engine_computed_is_loaded_by_another(
    make_engine, default_tokenizer, stores
) -> None:
    a, b = make_engine(), make_engine()
    store_a, store_b = stores(a), stores(b)
    _export_to(a, store_a)
    ids = _prompt(default_tokenizer, "lighthouses")
    (want,) = a.generate([ids], GREEDY)
    assert store_a.flush()
    full = (len(ids) - 1) // BS
    # prompt and output: every token but the last sampled one has KV
    assert store_a.stats.stored_blocks == (len(ids) + GREEDY.max_tokens - 1) // BS

    aengine = AsyncEngine(b)
    aengine.start()
    try:
        async with loaded_prefix(aengine, store_b, ids, timeout_s=10.0) as got:
            assert (got.blocks, got.tokens) == (full, full * BS)
            _, hashes = b.prefix_hashes(ids)
            for h in hashes:  # the bytes A computed, byte for byte
                assert torch.equal(_block_bytes(b, h), _block_bytes(a, h))
            events = [ev async for ev in aengine.generate("r1", ids, GREEDY)]
        await aengine.call(lambda: None)  # the hold's release, queued on the way out, ran
    finally:
        await aengine.stop()
    tokens = [t for ev in events for t in ev.new_token_ids]
    assert events[-1].num_cached_tokens == full * BS
    assert store_b.stats.hit_blocks == full
    assert store_b.stats.loaded_bytes == full * store_b.fmt.object_bytes
    assert b.blocks.num_free_blocks == b.blocks.num_blocks  # every hold dropped
    assert_greedy_equal(a, [ids], [tokens], [want.token_ids])
    # A's own second run reuses the same blocks from its cache: the very same computation.
    (again,) = a.generate([ids], GREEDY)
    assert again.num_cached_tokens == full * BS
    assert tokens == again.token_ids


async def test_a_prefill_engine_loads_and_the_decode_engine_gets_the_same_tokens(
    make_engine, default_tokenizer, stores
) -> None:
    writer, prefill, decode, colocated = (make_engine() for _ in range(4))
    store_w, store_p = stores(writer), stores(prefill)
    _export_to(writer, store_w)
    _export_to(prefill, store_p)
    ids = _prompt(default_tokenizer, "tides")
    writer.generate([ids], GREEDY)
    assert store_w.flush()

    aengine = AsyncEngine(prefill)
    aengine.start()
    try:
        async with loaded_prefix(aengine, store_p, ids, timeout_s=10.0) as got:
            admitted = await aengine.admit_prompt("r1", ids, GREEDY)
            res = decode.reserve("r1", ids, GREEDY)

            def copy(layer: int) -> None:
                _copy_layer(prefill.kv, decode.kv, layer, admitted.block_ids, res.block_ids)

            out = await aengine.run_prefill(admitted, copy)
            await aengine.release("r1")
    finally:
        await aengine.stop()
    assert got.blocks == (len(ids) - 1) // BS
    assert admitted.num_cached_tokens == got.tokens
    assert store_p.flush()
    assert store_p.stats.stored_blocks == 0  # what it loaded is not put back
    first = decode.add_prefilled("r1", out.token_id, out.logprob)
    tokens = list(first.new_token_ids)
    while decode.has_unfinished():
        tokens += [t for ev in decode.step() for t in ev.new_token_ids]
    (want,) = colocated.generate([ids], GREEDY)
    assert_greedy_equal(colocated, [ids], [tokens], [want.token_ids])


async def test_an_object_that_is_not_its_keys_block_is_refused(
    make_engine, default_tokenizer, stores
) -> None:
    engine, other = make_engine(), make_engine()
    store = stores(engine)
    ids = _prompt(default_tokenizer, "glaciers")
    _, hashes = engine.prefix_hashes(ids)
    # Under the first block's key: a well-formed object of the second block.
    fmt = store.fmt
    forged = torch.zeros(fmt.object_bytes, dtype=torch.uint8)
    forged[: len(fmt.header(hashes[1]))] = torch.frombuffer(
        bytearray(fmt.header(hashes[1])), dtype=torch.uint8
    )
    store.backend.register(forged.data_ptr(), forged.numel())
    assert store.backend.put_from([fmt.key(hashes[0])], [forged.data_ptr()], fmt.object_bytes)
    assert store.present_run(hashes) == 1

    aengine = AsyncEngine(engine)
    aengine.start()
    try:
        async with loaded_prefix(aengine, store, ids, timeout_s=10.0) as got:
            events = [ev async for ev in aengine.generate("r1", ids, GREEDY)]
    finally:
        await aengine.stop()
    assert got.blocks == 0
    assert store.stats.refused_blocks == 1
    assert events[-1].num_cached_tokens == 0
    (want,) = other.generate([ids], GREEDY)
    assert [t for ev in events for t in ev.new_token_ids] == want.token_ids


def test_a_full_write_buffer_drops_and_counts(make_engine, default_tokenizer, stores) -> None:
    engine = make_engine()
    fmt_bytes = BlockFormat.for_pool(engine.kv_spec, engine.model_digest).object_bytes
    store = stores(engine, write_buffer_bytes=2 * fmt_bytes, start=False)
    _export_to(engine, store)
    ids = _prompt(default_tokenizer, "volcanoes")
    engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
    full = len(ids) // BS
    assert store.stats.offered_blocks == full
    assert store.stats.dropped_blocks == full - 2  # the chain after the buffer filled
    store.start()
    assert store.flush()
    assert store.stats.stored_blocks == 2
    _, hashes = engine.prefix_hashes(ids)
    assert store.present_run(hashes) == 2


async def test_with_the_master_down_a_load_falls_back_and_after_its_restart_works_again(
    make_engine, default_tokenizer, stores, master: MooncakeMaster
) -> None:
    engine, other = make_engine(), make_engine()
    store, reader = stores(other), stores(engine)
    _export_to(other, store)
    ids = _prompt(default_tokenizer, "comets")
    master.kill()
    aengine = AsyncEngine(engine)
    aengine.start()
    try:
        t0 = time.monotonic()
        async with loaded_prefix(aengine, reader, ids, timeout_s=3.0) as got:
            assert got.blocks == 0
        assert time.monotonic() - t0 < 4.0
        await aengine.call(lambda: None)
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        master.restart()
        # The clients mount their segments on the new master by themselves.
        deadline = time.monotonic() + 20
        _, hashes = engine.prefix_hashes(ids)
        while time.monotonic() < deadline:
            other.blocks.reset_prefix_cache()
            store._known.clear()
            other.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
            store.flush()
            if store.present_run(hashes) == len(hashes):
                break
            time.sleep(0.5)
        async with loaded_prefix(aengine, reader, ids, timeout_s=10.0) as got:
            assert got.blocks == len(hashes)
    finally:
        await aengine.stop()


def _a_stored_prompt(make_engine, tokenizer, stores, topic: str):
    """A prompt whose blocks one engine computed and stored; another engine, its store and
    its (started) AsyncEngine to load them into."""
    writer, engine = make_engine(), make_engine()
    store_w, store = stores(writer), stores(engine)
    _export_to(writer, store_w)
    ids = _prompt(tokenizer, topic)
    writer.generate([ids], GREEDY)
    assert store_w.flush()
    aengine = AsyncEngine(engine)
    aengine.start()
    return engine, store, ids, aengine


async def test_a_load_abandoned_midway_frees_its_blocks_once_the_loader_stops(
    make_engine, default_tokenizer, stores
) -> None:
    """The caller goes away (a cancelled Prefill) while the loader thread writes into the
    claimed blocks: they stay held until it stops, then every block is free again."""
    engine, store, ids, aengine = _a_stored_prompt(make_engine, default_tokenizer, stores,
                                                   "canals")  # fmt: skip
    total = engine.blocks.num_blocks

    async def free() -> int:
        return int(await aengine.call(lambda: engine.blocks.num_free_blocks))

    async def use() -> None:
        async with loaded_prefix(aengine, store, ids, timeout_s=30.0):
            pass

    try:
        store._load_lock.acquire()  # the loader will wait here, its blocks claimed
        task = asyncio.create_task(use())
        deadline = time.monotonic() + 10
        while await free() == total:
            assert time.monotonic() < deadline, "no blocks were claimed"
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.2)
        assert await free() < total  # the loader may still write them: still held
        store._load_lock.release()
        deadline = time.monotonic() + 10
        while await free() != total:
            assert time.monotonic() < deadline, "the claimed blocks were never freed"
            await asyncio.sleep(0.05)
    finally:
        if store._load_lock.locked():
            store._load_lock.release()
        await aengine.stop()


async def test_a_load_abandoned_before_its_blocks_are_committed_leaks_none(
    make_engine, default_tokenizer, stores, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller goes away after the blocks were loaded, while their commit waits for the
    engine thread (which then skips it): the claimed blocks are freed all the same."""
    import threading

    engine, store, ids, aengine = _a_stored_prompt(make_engine, default_tokenizer, stores,
                                                   "harbours")  # fmt: skip
    total = engine.blocks.num_blocks
    gate, found = threading.Event(), threading.Event()
    load = store.load

    def load_then_hold_the_engine(*args: object) -> int:
        n = load(*args)  # type: ignore[arg-type]
        aengine.submit(lambda: gate.wait(10))  # the commit queues behind this
        found.set()
        return n

    monkeypatch.setattr(store, "load", load_then_hold_the_engine)

    async def use() -> None:
        async with loaded_prefix(aengine, store, ids, timeout_s=30.0):
            pass

    try:
        task = asyncio.create_task(use())
        assert await asyncio.to_thread(found.wait, 10)
        await asyncio.sleep(0.2)  # the commit is queued now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()  # the cancelled commit is skipped
        deadline = time.monotonic() + 10
        while await aengine.call(lambda: engine.blocks.num_free_blocks) != total:
            assert time.monotonic() < deadline, "the blocks claimed for nobody leaked"
            await asyncio.sleep(0.05)
    finally:
        gate.set()
        await aengine.stop()

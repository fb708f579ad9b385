"""The engine thread behind asyncio: streams, concurrency, cancellation, roles."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from tests.engine.parity import assert_greedy_equal

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3,"]


async def _collect(aeng: AsyncEngine, rid: str, prompt: str) -> list[int]:
    toks: list[int] = []
    async for ev in aeng.generate(rid, prompt, GREEDY):
        toks.extend(ev.new_token_ids)
    return toks


async def test_concurrent_streams_equal_sync_generate(make_engine) -> None:
    sync = make_engine()
    expected = [r.token_ids for r in sync.generate(PROMPTS, GREEDY)]
    aeng = AsyncEngine(make_engine())
    aeng.start()
    try:
        got = await asyncio.wait_for(
            asyncio.gather(*(_collect(aeng, f"r{i}", p) for i, p in enumerate(PROMPTS))), 120
        )
    finally:
        await aeng.stop()
    # the streams may join the batch at other steps than sync generate's: other GEMM shapes
    assert_greedy_equal(sync, PROMPTS, got, expected)


async def test_consumer_going_away_frees_blocks(make_engine) -> None:
    eng = make_engine()
    aeng = AsyncEngine(eng)
    aeng.start()
    try:
        stream = aeng.generate("x", "Tell me a long story", SamplingParams(max_tokens=500))
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(100):
            if eng.blocks.num_free_blocks == eng.blocks.num_blocks and not eng.has_unfinished():
                break
            await asyncio.sleep(0.02)
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
        assert not eng.has_unfinished()
    finally:
        await aeng.stop()


async def test_bad_request_raises_and_engine_keeps_serving(make_engine) -> None:
    aeng = AsyncEngine(make_engine())
    aeng.start()
    try:
        with pytest.raises(InvalidRequestError):
            async for _ in aeng.generate("bad", "", GREEDY):
                pass
        assert len(await _collect(aeng, "good", "Hello")) == GREEDY.max_tokens
    finally:
        await aeng.stop()


async def test_prefill_and_decode_roles(make_engine, default_tokenizer) -> None:
    ids = default_tokenizer.encode("The three primary colors are")
    expected = make_engine().generate([ids], GREEDY)[0].token_ids
    pre, dec = AsyncEngine(make_engine(num_kv_blocks=32)), AsyncEngine(make_engine())
    pre.start()
    dec.start()
    try:
        blocks = (await dec.reserve("r", ids, GREEDY)).block_ids
        layers: list[int] = []

        admitted = await pre.admit_prompt("r", ids, GREEDY)

        def hook(layer: int) -> None:
            layers.append(layer)
            src, dst = pre.engine.kv, dec.engine.kv
            bb = src.spec.block_bytes
            for kv in (0, 1):
                for s, d in zip(admitted.block_ids, blocks, strict=True):
                    so, do = src.spec.offset(layer, kv, s), dst.spec.offset(layer, kv, d)
                    dst.as_bytes()[do : do + bb] = src.as_bytes()[so : so + bb]

        out = await pre.run_prefill(admitted, hook)
        assert layers == list(range(30))
        assert await pre.release("r")
        toks: list[int] = []
        async for ev in dec.join_prefilled("r", out.token_id, out.logprob):
            toks.extend(ev.new_token_ids)
        assert toks == expected
        assert (
            pre.stats.free_blocks == pre.stats.total_blocks
            or pre.engine.blocks.num_free_blocks == 32
        )
    finally:
        await pre.stop()
        await dec.stop()


async def test_a_prefills_blocks_stay_held_until_release_even_when_cancelled(
    make_engine, default_tokenizer
) -> None:
    """A transfer may still read a prefill's blocks after the caller stopped waiting for
    it: only ``release`` frees them, and it drops the prompt too if it had not run."""
    ids = default_tokenizer.encode("The three primary colors are")
    pre = AsyncEngine(make_engine(num_kv_blocks=32, prefix_caching=False))
    pre.start()

    async def free() -> int:
        return await pre.call(lambda: pre.engine.blocks.num_free_blocks)

    try:
        total = await free()
        admitted = await pre.admit_prompt("ran", ids, GREEDY)
        held = total - await free()
        assert held == len(admitted.block_ids) > 0
        await pre.run_prefill(admitted)
        assert await free() == total - held  # computed, still held
        assert await pre.release("ran") and await free() == total

        admitted = await pre.admit_prompt("cancelled", ids, GREEDY)
        layers: list[int] = []
        # Keep the engine thread busy so the prompt is still queued when the caller leaves.
        busy = asyncio.ensure_future(pre.call(lambda: time.sleep(0.3)))
        task = asyncio.ensure_future(pre.run_prefill(admitted, layers.append))
        await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await busy
        await asyncio.sleep(0.5)  # time enough to have computed it, had it not been dropped
        assert layers == []  # dropped before it ran
        assert await free() == total - held  # the caller left; the blocks did not
        assert await pre.release("cancelled") and await free() == total
        assert not await pre.release("cancelled")
    finally:
        await pre.stop()


async def test_cancelling_right_after_submit_never_leaks_a_request(make_engine) -> None:
    eng = make_engine()
    aeng = AsyncEngine(eng)
    aeng.start()
    try:
        for i in range(20):

            async def consume(rid: str = f"c{i}") -> None:
                async for _ in aeng.generate(
                    rid, "Tell me a story", SamplingParams(max_tokens=2000)
                ):
                    pass

            task = asyncio.ensure_future(consume())
            for _ in range(i % 4):  # cancel at different points of the submission
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for _ in range(100):
            if not eng.has_unfinished():
                break
            await asyncio.sleep(0.02)
        assert not eng.has_unfinished()
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    finally:
        await aeng.stop()


def _record_steps(eng) -> list[float]:
    """Wrap ``eng.step`` to log when each step starts (monotonic seconds)."""
    starts: list[float] = []
    step = eng.step

    def timed_step():
        starts.append(time.monotonic())
        return step()

    eng.step = timed_step
    return starts


async def test_each_step_waits_until_its_tokens_reached_their_consumer(make_engine) -> None:
    eng = make_engine()
    starts = _record_steps(eng)
    aeng = AsyncEngine(eng, delivery_wait_s=5.0)  # generous: the loop always gets its turn
    aeng.start()
    received: list[float] = []
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        async for _ in aeng.generate("w", "Count to ten:", params):
            received.append(time.monotonic())
    finally:
        await aeng.stop()
    assert len(received) == 8 and len(starts) >= 8
    # step k produced token k; step k + 1 began only after the consumer had token k
    for k in range(7):
        assert starts[k] < received[k] <= starts[k + 1], k
    assert aeng.num_delivery_waits == 0


@pytest.mark.parametrize(
    ("options", "waits_run_out"),
    [({"delivery_wait_s": 0.01}, True), ({}, False)],  # unset: the engine waits for nobody
)
async def test_a_blocked_event_loop_delays_a_step_by_at_most_the_wait(
    make_engine, options: dict[str, float], waits_run_out: bool
) -> None:
    eng = make_engine()
    starts = _record_steps(eng)
    aeng = AsyncEngine(eng, **options)
    aeng.start()
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        stream = aeng.generate("b", "Count to ten:", params)
        await anext(stream)
        t0 = time.monotonic()
        time.sleep(1.0)  # block the event loop: the engine thread must not wait for it
        steps_while_blocked = sum(1 for s in starts if t0 < s < t0 + 1.0)
        rest = [ev async for ev in stream]
    finally:
        await aeng.stop()
    assert steps_while_blocked >= 1
    assert (aeng.num_delivery_waits >= 1) is waits_run_out
    assert sum(len(ev.new_token_ids) for ev in rest) == 5


def test_a_negative_delivery_wait_is_refused(make_engine) -> None:
    with pytest.raises(ValueError, match="delivery_wait_s"):
        AsyncEngine(make_engine(), delivery_wait_s=-1.0)


async def test_on_step_reports_every_step_and_a_failing_hook_is_contained(make_engine) -> None:
    aeng = AsyncEngine(make_engine())
    seen: list[tuple[str, float, int]] = []

    def hook(kind: str, seconds: float, size: int) -> None:
        seen.append((kind, seconds, size))
        if len(seen) == 2:
            raise RuntimeError("a broken metrics hook")

    aeng.on_step = hook
    aeng.start()
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        events = [ev async for ev in aeng.generate("h", "Count to ten:", params)]
    finally:
        await aeng.stop()
    assert sum(len(ev.new_token_ids) for ev in events) == 6  # the raise stopped nothing
    steps = [s for s in seen if s[0] == "step"]
    assert len(steps) == 6 and all(sec > 0 and size == 1 for _, sec, size in steps)


def _thread_status(tid: int) -> tuple[str, set[int]]:
    """(OS name, cores) of a thread of this process, as ``top -H`` and the kernel see them."""
    with open(f"/proc/self/task/{tid}/comm") as f:
        name = f.read().strip()
    return name, os.sched_getaffinity(tid)


async def test_the_engine_thread_runs_on_its_cores_and_the_caller_keeps_its_own(
    make_engine,
) -> None:
    cores = sorted(os.sched_getaffinity(0))
    mine = set(cores)
    aeng = AsyncEngine(make_engine(), cpus={cores[-1]})
    aeng.start()
    try:
        tid = aeng.native_thread_id
        assert tid is not None
        assert _thread_status(tid) == ("pdserve-engine", {cores[-1]})
        assert os.sched_getaffinity(0) == mine  # only the engine thread moved
        assert len(await _collect(aeng, "pinned", "Hello")) == GREEDY.max_tokens
    finally:
        await aeng.stop()
    # Unpinned (the default): the engine thread keeps the process's cores.
    aeng = AsyncEngine(make_engine())
    aeng.start()
    try:
        tid = aeng.native_thread_id
        assert tid is not None
        assert _thread_status(tid) == ("pdserve-engine", mine)
    finally:
        await aeng.stop()


async def test_cores_the_system_refuses_fail_start_and_bad_ones_fail_construction(
    make_engine,
) -> None:
    eng = make_engine()
    aeng = AsyncEngine(eng, cpus={os.cpu_count() + 4096})  # no such core
    with pytest.raises(OSError, match="cannot run the engine thread on cores"):
        aeng.start()
    assert aeng._thread is not None and not aeng._thread.is_alive()
    for bad in (set(), {-1}, {"0"}, {True}):
        with pytest.raises(ValueError, match="cpus must be"):
            AsyncEngine(eng, cpus=bad)  # type: ignore[arg-type]

"""A prefill-only prompt longer than a pass's budget is computed chunk by chunk: the same KV
and first token as one pass, its layers handed to the transfer once (in the last chunk),
and a cancel between chunks computes no further chunk."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import torch

from engine.async_engine import AsyncEngine
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
TEXT = "The lighthouse keeper wrote down every ship that passed the rocks that winter. " * 12


def _kv_of(engine, block_ids) -> torch.Tensor:
    """Every layer's K and V of ``block_ids`` (pool: [layer, k/v, block, ...]), as float32."""
    return engine.kv.pool[:, :, torch.tensor(block_ids)].float()


def test_chunks_give_one_passs_kv_and_first_token(make_engine, default_tokenizer) -> None:
    ids = default_tokenizer.encode(TEXT)
    whole, chunked = make_engine(num_kv_blocks=64), make_engine(num_kv_blocks=64)
    (one,) = whole.run_prefill([admitted := whole.admit_prompt("r", ids, GREEDY)])
    plan_c = chunked.admit_prompt("r", ids, GREEDY)
    outs, chunks = [], 0
    while chunked.prefill_pending("r"):
        outs += chunked.run_prefill([plan_c], max_tokens=[40])  # not a block multiple
        chunks += 1
    assert chunks == -(-len(ids) // 40) > 2
    (last,) = outs
    assert last.token_id == one.token_id and last.num_prompt_tokens == len(ids)
    # another GEMM shape per chunk: equal up to summation order, not bit for bit
    torch.testing.assert_close(
        _kv_of(chunked, plan_c.block_ids), _kv_of(whole, admitted.block_ids), rtol=1e-3, atol=1e-3
    )


async def test_a_long_prompt_runs_in_chunks_and_a_cancel_stops_it(
    make_engine, default_tokenizer
) -> None:
    ids = default_tokenizer.encode(TEXT)
    budget = 48
    pre = AsyncEngine(
        make_engine(num_kv_blocks=64, prefix_caching=False), prefill_token_budget=budget
    )
    pre.start()

    async def free() -> int:
        return await pre.call(lambda: pre.engine.blocks.num_free_blocks)

    try:
        total = await free()
        # Run to the end: chunks of the budget, the layers handed over once, in the last.
        admitted = await pre.admit_prompt("whole", ids, GREEDY)
        chunks: list[int] = []
        layers: list[int] = []
        out = await pre.run_prefill(admitted, layers.append, chunks.append)
        assert chunks == [budget] * (len(ids) // budget) + [len(ids) % budget] * bool(
            len(ids) % budget
        )
        assert layers == list(range(pre.engine.model_config.num_layers))
        assert out.num_prompt_tokens == len(ids)
        assert await pre.release("whole") and await free() == total

        # Cancelled once its first chunk is computed: no other chunk runs, no layer is
        # handed over, and the blocks stay held until release.
        admitted = await pre.admit_prompt("cancelled", ids, GREEDY)
        chunks.clear()
        layers.clear()
        loop = asyncio.get_running_loop()
        left = threading.Event()
        task: asyncio.Future[object] | None = None

        def on_computed(n: int) -> None:
            chunks.append(n)
            assert task is not None
            loop.call_soon_threadsafe(task.cancel)
            left.wait(30)  # the engine thread's next pass comes after the caller left

        task = asyncio.ensure_future(pre.run_prefill(admitted, layers.append, on_computed))
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 60)
        left.set()
        assert task.cancelled()
        await pre.call(lambda: None)  # a pass that would have run has run by now
        assert chunks == [budget] and layers == []
        assert pre.engine.prefill_pending("cancelled") == len(ids) - budget
        assert await free() < total
        assert await pre.release("cancelled") and await free() == total
    finally:
        await pre.stop()

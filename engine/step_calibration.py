"""Timing an engine's decode steps on dummy sequences, for its ``StepBudget``
(``engine/step_budget.py``) before it serves.

Each dummy sequence holds ``CONTEXT_TOKENS`` tokens of KV (fewer in a pool too small for
that) in blocks taken from the pool (their
bytes are whatever the pool holds: a step's time does not depend on them) and decodes one
token a step, as a served sequence does. Nothing is cached, nothing is emitted, and the
blocks go back to the pool before it returns. Steps: one untimed per batch size first (a
first pass pays for allocations and kernel selection), then ``REPEATS`` timed.
"""

from __future__ import annotations

import time

from engine.block_manager import BlockManager
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence

CONTEXT_TOKENS = 128
"""A dummy sequence's context: a short chat turn's."""

LARGE_BATCH = 8
"""The larger batch timed (at most max_num_seqs, and what the free blocks hold)."""

REPEATS = 3


def calibration_batches(max_num_seqs: int, free_blocks: int, blocks_per_seq: int) -> list[int]:
    """The batch sizes to time: 1, and ``LARGE_BATCH`` or as many as fit below it (none
    larger when fewer than two fit)."""
    large = min(LARGE_BATCH, max_num_seqs, free_blocks // max(1, blocks_per_seq))
    return [1, large] if large > 1 else [1]


def time_decode_steps(
    runner: ModelRunner, blocks: BlockManager, max_num_seqs: int
) -> list[tuple[int, float]]:
    """(batch, seconds) of each timed decode step (module docstring). ``ValueError`` when
    no block is free."""
    free = blocks.num_free_blocks
    if free < 1:
        raise ValueError("calibration needs a free KV block, the pool has none")
    context = min(CONTEXT_TOKENS, free * blocks.block_size)
    per_seq = blocks.blocks_needed(context)
    samples: list[tuple[int, float]] = []
    for batch in calibration_batches(max_num_seqs, free, per_seq):
        seqs = [_dummy(i, context, blocks.allocate(per_seq)) for i in range(batch)]
        try:
            items = [ScheduledSeq(seq, 1) for seq in seqs]
            runner.execute(items)
            for _ in range(REPEATS):
                t0 = time.perf_counter()
                runner.execute(items)
                samples.append((batch, time.perf_counter() - t0))
        finally:
            for seq in seqs:
                blocks.free(seq.block_table)
    return samples


def _dummy(i: int, context: int, block_table: list[int]) -> Sequence:
    """A sequence of ``context`` tokens whose next step decodes its last one."""
    seq = Sequence(f"__calibration_{i}__", [0] * context, SamplingParams(max_tokens=1), 0.0)
    seq.block_table = block_table
    seq.num_computed = context - 1
    return seq

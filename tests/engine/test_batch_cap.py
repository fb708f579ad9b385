"""The running batch's cap from the ITL target: the batch scheduler admits below it, a
decode worker's reservations stop at it, served steps refresh it, calibration starts it."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.block_manager import BlockManager
from engine.errors import ResourceExhaustedError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.scheduler import BatchLimits, Scheduler
from engine.sequence import Sequence
from engine.step_budget import ITL_TARGET_FACTOR, StepBudget
from engine.step_calibration import calibration_batches

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _budget(cap: int, max_num_seqs: int = 64) -> StepBudget:
    """A budget whose line is 10 ms a sequence, with a target that fits ``cap`` of them."""
    samples = [(1, 0.010), (8, 0.080)]
    return StepBudget.calibrated(samples, max_num_seqs=max_num_seqs, target_s=0.010 * cap)


def _waiting(scheduler: Scheduler, n: int) -> None:
    for i in range(n):
        scheduler.add(Sequence(f"r{i}", [1, 2, 3], GREEDY, 0.0))


def test_scheduler_admits_below_the_cap_and_more_once_it_rises() -> None:
    scheduler = Scheduler(BatchLimits(8, 4096, False), BlockManager(64, 16))
    _waiting(scheduler, 6)
    first = scheduler.schedule(max_running=2)
    assert len(first.scheduled) == 2 and len(scheduler.running) == 2
    assert len(scheduler.schedule(max_running=2).scheduled) == 2  # no one more
    assert len(scheduler.running) == 2
    scheduler.schedule(max_running=5)
    assert len(scheduler.running) == 5
    scheduler.schedule(max_running=1)  # a lower cap preempts nobody
    assert len(scheduler.running) == 5
    scheduler.schedule(max_running=100)  # never past max_num_seqs
    assert len(scheduler.running) == 6


def test_scheduler_default_cap_is_max_num_seqs() -> None:
    scheduler = Scheduler(BatchLimits(3, 4096, False), BlockManager(64, 16))
    _waiting(scheduler, 5)
    scheduler.schedule()
    assert len(scheduler.running) == 3


@pytest.mark.parametrize(
    ("max_num_seqs", "free", "per_seq", "batches"),
    [(64, 512, 8, [1, 8]), (4, 512, 8, [1, 4]), (64, 20, 8, [1, 2]), (64, 10, 8, [1]),
     (1, 512, 8, [1])],
)  # fmt: skip
def test_calibration_batches(max_num_seqs: int, free: int, per_seq: int, batches) -> None:
    assert calibration_batches(max_num_seqs, free, per_seq) == batches


def test_engine_runs_no_more_than_its_cap(make_engine: Callable[..., LLMEngine], prompts) -> None:
    engine = make_engine(max_num_seqs=8)
    engine.step_budget = _budget(2, max_num_seqs=8)
    for i in range(5):
        engine.add_request(prompts[i % len(prompts)], GREEDY, f"r{i}")
    seen = []
    for _ in range(2):  # the prompts' step, then a decode step: none of them finishes
        engine.step()
        seen.append(len(engine.scheduler.running))
    assert max(seen) == 2
    engine.step_budget = _budget(4, max_num_seqs=8)  # the cap rises: more join
    engine.step()
    assert len(engine.scheduler.running) == 4
    while engine.has_unfinished():
        engine.step()
        assert len(engine.scheduler.running) <= 4


def test_reservations_stop_at_the_cap(make_engine: Callable[..., LLMEngine], prompts) -> None:
    decode = make_engine(num_kv_blocks=128, max_num_seqs=8)
    decode.step_budget = _budget(2, max_num_seqs=8)
    decode.reserve("a", prompts[0], GREEDY)
    decode.reserve("b", prompts[1], GREEDY)
    with pytest.raises(ResourceExhaustedError, match="ITL target"):
        decode.reserve("c", prompts[2], GREEDY)
    assert decode.num_held == 2  # the refused one holds nothing
    decode.step_budget = _budget(3, max_num_seqs=8)
    decode.reserve("c", prompts[2], GREEDY)
    for rid in "abc":
        assert decode.release(rid)
    assert decode.blocks.num_free_blocks == decode.blocks.num_blocks


def test_decode_steps_refresh_the_model_and_prompt_steps_do_not(
    make_engine: Callable[..., LLMEngine], prompts
) -> None:
    engine = make_engine()
    engine.step_budget = _budget(4)
    engine.add_request(prompts[0], GREEDY, "a")
    engine.step()  # computes the prompt
    assert engine.step_budget.recent.w == 0
    engine.step()  # decodes
    assert engine.step_budget.recent.w == 1
    assert engine.step_budget.recent.wx == 1  # one sequence


def test_calibration_starts_the_budget_and_gives_every_block_back(
    make_engine: Callable[..., LLMEngine],
) -> None:
    engine = make_engine(max_num_seqs=16)
    assert engine.batch_cap == 16 and engine.itl_target_s == 0  # before: no target yet
    budget = engine.calibrate()
    assert budget.quiet_step_s is not None and budget.quiet_step_s > 0
    assert engine.itl_target_s == pytest.approx(ITL_TARGET_FACTOR * budget.quiet_step_s)
    assert budget.model is not None  # two batch sizes timed (its slope: test_step_budget)
    assert 1 <= engine.batch_cap <= 16
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not engine.has_unfinished() and engine.num_held == 0
    assert engine.generate([[1, 2, 3]], GREEDY)[0].finish_reason == "length"


def test_throughput_mode_skips_calibration(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(max_num_seqs=16, itl_target_ms=0)
    assert engine.calibrate().quiet_step_s is None
    assert (engine.batch_cap, engine.itl_target_s) == (16, 0.0)


def test_an_explicit_target_is_kept(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(itl_target_ms=1e-3)  # a microsecond: nothing fits but one
    assert engine.itl_target_s == pytest.approx(1e-6)
    engine.calibrate()
    assert engine.itl_target_s == pytest.approx(1e-6)
    assert engine.batch_cap == 1

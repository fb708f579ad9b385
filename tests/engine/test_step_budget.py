"""The step-time model and the batch cap it gives (``engine/step_budget.py``): pure."""

from __future__ import annotations

import pytest

from engine.step_budget import (
    ANCHOR_WEIGHT,
    CLIP,
    HALF_LIFE_STEPS,
    ITL_TARGET_FACTOR,
    StepBudget,
    StepFit,
    StepTimeModel,
)

# A CPU-like line, 10 ms a step plus 4 ms a sequence, and some interference.
CALIBRATION = [(1, 0.015), (1, 0.014), (1, 0.090), (8, 0.044), (8, 0.042), (8, 0.043)]


def test_a_line_through_two_batch_sizes() -> None:
    fit = StepFit().plus(1, 0.014).plus(8, 0.042)
    line = fit.line()
    assert line is not None
    assert line.per_seq_s == pytest.approx(0.004)
    assert line.base_s == pytest.approx(0.010)
    assert line.predict(16) == pytest.approx(0.074)


def test_one_batch_size_gives_no_line() -> None:
    assert StepFit().line() is None
    assert StepFit().plus(4, 0.02).plus(4, 0.03).line() is None


def test_a_falling_line_reads_as_flat() -> None:
    line = StepFit().plus(1, 0.020).plus(8, 0.010).line()
    assert line == StepTimeModel(pytest.approx(0.015), 0.0)


@pytest.mark.parametrize(
    ("target_ms", "most", "cap"),
    [
        (38, 64, 7),  # 10 + 4*7 = 38 fits exactly
        (37.9, 64, 6),
        (1000, 64, 64),  # bounded by max_num_seqs
        (5, 64, 1),  # slower than the target alone: still one at a time
    ],
)
def test_largest_batch_within(target_ms: float, most: int, cap: int) -> None:
    line = StepTimeModel(0.010, 0.004)
    assert line.largest_batch_within(target_ms / 1000, most) == cap


def test_flat_line_takes_everything_or_one() -> None:
    assert StepTimeModel(0.01, 0.0).largest_batch_within(0.02, 32) == 32
    assert StepTimeModel(0.03, 0.0).largest_batch_within(0.02, 32) == 1


def test_calibrated_default_target_is_a_multiple_of_the_quiet_step() -> None:
    budget = StepBudget.calibrated(CALIBRATION, max_num_seqs=64, target_s=None)
    # the fastest step per batch: interference only adds time
    assert budget.quiet_step_s == pytest.approx(0.014)
    assert budget.target_s == pytest.approx(ITL_TARGET_FACTOR * 0.014)
    assert budget.model.per_seq_s == pytest.approx(0.004)  # type: ignore[union-attr]
    # the largest B with 10 + 4 * B ms within the target
    assert budget.cap == int((ITL_TARGET_FACTOR * 14 - 10) // 4)


def test_an_explicit_target_wins() -> None:
    budget = StepBudget.calibrated(CALIBRATION, max_num_seqs=64, target_s=0.1)
    assert budget.target_s == 0.1
    assert budget.cap == 22  # 10 + 4 * 22 = 98 ms


def test_calibration_needs_batch_one() -> None:
    with pytest.raises(ValueError, match="batch 1"):
        StepBudget.calibrated([(8, 0.04)], max_num_seqs=64, target_s=None)


def test_no_target_or_no_line_caps_at_max_num_seqs() -> None:
    assert StepBudget(64).cap == 64  # throughput mode, or not calibrated
    no_target = StepBudget.calibrated(CALIBRATION, max_num_seqs=64, target_s=None)
    assert StepBudget(64, None, no_target.anchor).cap == 64
    only_batch_one = StepBudget.calibrated([(1, 0.014)], max_num_seqs=64, target_s=None)
    assert only_batch_one.model is None
    assert only_batch_one.cap == 64


def test_served_steps_move_the_cap() -> None:
    budget = StepBudget.calibrated(CALIBRATION, max_num_seqs=64, target_s=0.040)
    assert budget.cap == 7
    # Longer contexts: every sequence now costs 6 ms, not 4. The cap follows within a few
    # dozen steps: 10 + 6 * 5 = 40 ms.
    slower = budget
    for _ in range(4 * int(ANCHOR_WEIGHT)):
        for batch in (3, 5, 7):
            slower = slower.observed(batch, 0.010 + 0.006 * batch)
    assert slower.cap == 5
    # ... and back once the contexts are short again
    faster = slower
    for _ in range(HALF_LIFE_STEPS):
        for batch in (3, 5, 7):
            faster = faster.observed(batch, 0.010 + 0.004 * batch)
    assert faster.cap == 7


def test_one_stalled_step_moves_the_line_a_bounded_amount() -> None:
    budget = StepBudget.calibrated(CALIBRATION, max_num_seqs=64, target_s=0.040)
    steady = budget
    for _ in range(50):
        steady = steady.observed(7, 0.038)
    assert steady.cap == 7
    stalled = steady.observed(7, 5.0)  # a 5 s hiccup counts as CLIP x the prediction
    clipped = steady.observed(7, CLIP * steady.model.predict(7))  # type: ignore[union-attr]
    assert stalled.recent == clipped.recent
    assert stalled.cap >= 6


def test_uncalibrated_budget_learns_a_line_from_served_steps() -> None:
    budget = StepBudget(64, target_s=0.03)
    assert budget.cap == 64
    for batch in (1, 4, 1, 4):
        budget = budget.observed(batch, 0.010 + 0.004 * batch)
    assert budget.cap == 5

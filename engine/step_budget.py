"""How many sequences a decode step may hold and stay within an ITL target: the step-time
model and the batch cap it gives. Pure: numbers in, numbers out; the engine times its steps
and holds the current ``StepBudget`` (one owner: the engine thread).

Model. A decode step reads every weight once, whatever its batch, and each sequence adds
its rows of the products, its attention over its context and its logits, so its time is
close to a line in the batch size: ``t(B) = base + per_seq * B`` (the contexts being
served land in ``per_seq``).

Fit. Weighted least squares over (batch, seconds) points of two kinds:

- the calibration's: decode steps on dummy sequences at batch 1 and a larger batch, timed
  before the worker reports READY (``engine/step_calibration.py``), the fastest per batch
  (interference only ever adds time), each weighing ``ANCHOR_WEIGHT`` steps for good, so
  the line always has two ends;
- the served steps' (pure decode steps only: a step that computes a prompt is not a decode
  step), each weighing 1 at first and half as much ``HALF_LIFE_STEPS`` steps later, so the
  line follows the contexts being served and the machine's speed now. One observation is
  first clipped into [1/``CLIP``, ``CLIP``] x the line's prediction: a stalled step (a
  page fault, a neighbour's burst) moves the line by a bounded amount, a lasting change
  within a few dozen steps.

Cap. The largest batch whose predicted step fits the target, within [1, max_num_seqs]: at
least 1, so a worker slower than its target still serves, one sequence at a time. Without
a target (throughput mode) or a line (no two batch sizes seen yet) the cap is max_num_seqs.

Default target: ``ITL_TARGET_FACTOR`` x the calibrated batch-1 step: a stream's tokens
come at most that much slower under load than alone, and never more slowly without bound.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

ITL_TARGET_FACTOR = 8.0
"""The default ITL target, in calibrated batch-1 steps. On a CPU a step grows steeply with
the batch: at 3 the target held a batch below the interference workload's; at 8 it holds
about the batch the overload check passes at (docs/benchmarks.md, "The decode core does
decode only")."""

ANCHOR_WEIGHT = 16.0
"""What one calibration point weighs, in served steps."""

HALF_LIFE_STEPS = 256
"""Served steps after which a served step's weight has halved."""

CLIP = 2.0
"""A served step counts as at most this many times the prediction (and at least 1/CLIP)."""

_DECAY = 0.5 ** (1.0 / HALF_LIFE_STEPS)


@dataclass(frozen=True)
class StepTimeModel:
    """``t(B) = base_s + per_seq_s * B`` seconds; ``per_seq_s >= 0``."""

    base_s: float
    per_seq_s: float

    def predict(self, batch: int) -> float:
        return self.base_s + self.per_seq_s * batch

    def largest_batch_within(self, target_s: float, most: int) -> int:
        """The largest ``B`` in [1, ``most``] with ``predict(B) <= target_s``; 1 when none."""
        if self.per_seq_s <= 0:
            return most if self.base_s <= target_s else 1
        fits = math.floor((target_s - self.base_s) / self.per_seq_s + 1e-9)
        return max(1, min(most, fits))


@dataclass(frozen=True)
class StepFit:
    """The weighted sums a least-squares line of seconds over batch size needs."""

    w: float = 0.0
    wx: float = 0.0
    wy: float = 0.0
    wxx: float = 0.0
    wxy: float = 0.0

    def plus(self, batch: int, seconds: float, weight: float = 1.0) -> StepFit:
        x, y = float(batch), seconds
        return StepFit(self.w + weight, self.wx + weight * x, self.wy + weight * y,
                       self.wxx + weight * x * x, self.wxy + weight * x * y)  # fmt: skip

    def scaled(self, factor: float) -> StepFit:
        f = factor
        return StepFit(self.w * f, self.wx * f, self.wy * f, self.wxx * f, self.wxy * f)

    def __add__(self, other: StepFit) -> StepFit:
        return StepFit(self.w + other.w, self.wx + other.wx, self.wy + other.wy,
                       self.wxx + other.wxx, self.wxy + other.wxy)  # fmt: skip

    def line(self) -> StepTimeModel | None:
        """The fitted line; None until points at two batch sizes carry weight. A falling
        line (noise) is read as flat: a step never gets cheaper with more sequences."""
        det = self.w * self.wxx - self.wx * self.wx
        if self.w <= 0 or det <= 1e-9 * self.w * self.wxx:
            return None
        slope = (self.w * self.wxy - self.wx * self.wy) / det
        if slope <= 0:
            return StepTimeModel(self.wy / self.w, 0.0)
        return StepTimeModel((self.wy - slope * self.wx) / self.w, slope)


@dataclass(frozen=True)
class StepBudget:
    """The running batch's cap under an ITL target, and what it is computed from.

    ``target_s``: the ITL target in seconds; None: none (throughput mode, or an automatic
    target before calibration). ``anchor``: the calibration's points; ``recent``: the
    served steps', decayed.
    """

    max_num_seqs: int
    target_s: float | None = None
    anchor: StepFit = StepFit()
    recent: StepFit = StepFit()
    quiet_step_s: float | None = None
    """The calibrated batch-1 step (None: not calibrated)."""

    @classmethod
    def calibrated(
        cls,
        samples: Iterable[tuple[int, float]],
        *,
        max_num_seqs: int,
        target_s: float | None,
    ) -> StepBudget:
        """A budget from calibration ``samples`` of (batch, seconds), among them batch 1;
        ``target_s`` None: ``ITL_TARGET_FACTOR`` x the fastest batch-1 step. ``ValueError``
        without a batch-1 sample."""
        by_batch: dict[int, list[float]] = {}
        for batch, seconds in samples:
            by_batch.setdefault(batch, []).append(seconds)
        if 1 not in by_batch:
            raise ValueError("calibration needs steps at batch 1")
        anchor = StepFit()
        for batch, times in sorted(by_batch.items()):
            anchor = anchor.plus(batch, min(times), ANCHOR_WEIGHT)
        quiet = min(by_batch[1])
        target = ITL_TARGET_FACTOR * quiet if target_s is None else target_s
        return cls(max_num_seqs, target, anchor, StepFit(), quiet)

    @property
    def model(self) -> StepTimeModel | None:
        return (self.anchor + self.recent).line()

    @property
    def cap(self) -> int:
        """The most sequences the running batch may hold now (module docstring)."""
        model = self.model
        if self.target_s is None or model is None:
            return self.max_num_seqs
        return model.largest_batch_within(self.target_s, self.max_num_seqs)

    def observed(self, batch: int, seconds: float) -> StepBudget:
        """This budget after a served decode step of ``batch`` sequences took ``seconds``."""
        model = self.model
        if model is not None:
            expected = model.predict(batch)
            if expected > 0:
                seconds = min(max(seconds, expected / CLIP), expected * CLIP)
        recent = self.recent.scaled(_DECAY).plus(batch, seconds)
        return dataclasses.replace(self, recent=recent)

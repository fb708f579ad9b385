"""The planner on synthetic profiles whose answers are worked out by hand below."""

from __future__ import annotations

import math

import pytest

from bench.plan.model import (
    InfeasibleError,
    Mode,
    PlanError,
    Workload,
    exposed_transfer_s,
    local_prefill_limit,
    max_batch_within,
    md1_wait,
    plan,
    running_batch,
)
from tests.bench.plan.synthetic import linear_profile


def _workload(**overrides: object) -> Workload:
    base: dict[str, object] = {
        "rate": 2.0,
        "prompt_tokens": 1000,
        "output_tokens": 100,
        "slo_ttft_s": 1.0,
        "slo_itl_s": 0.100,
    }
    base.update(overrides)
    return Workload(**base)  # type: ignore[arg-type]


# Hand computation (formulas: bench/plan/model.py's docstring).
#   Profile: prefill 0.5 s per 1,000 tokens (linear); decode step 20 ms + 1 ms per sequence
#   (independent of context). Workload: λ = 2 req/s, P = 1,000, O = 100, TTFT SLO 1 s,
#   ITL SLO 100 ms, no transfer figures (X = 0).
#   S = 0.5 s; G = O - 1 = 99 decode steps per request.
#   Prefill pool: slack s = T - S - X = 0.5 s; ρ* = 2s / (S + 2s) = 1 / 1.5 = 2/3;
#     cap_p = ρ*/S = 4/3 req/s; n_p = ⌈2 / (4/3)⌉ = ⌈1.5⌉ = 2.
#     ρ_p = λS/n_p = 2 · 0.5 / 2 = 0.5; W = ρS / (2(1 - ρ)) = 0.25 / 1 = 0.25 s;
#     TTFT = W + S = 0.75 s.
#   Decode pool: 0.020 + 0.001 b <= 0.100 ⇔ b <= 80, so b_max = 80;
#     cap_d = 80 / (99 · 0.100) = 8.08 req/s; n_d = ⌈2 / 8.08⌉ = 1.
#     Running batch: b = 2 · 99 · (0.020 + 0.001 b) = 3.96 + 0.198 b ⇒ b = 3.96 / 0.802 = 4.93766;
#     ITL = 0.020 + 0.00493766 = 24.938 ms;
#     decode utilisation = 198 tok/s / (80 / 0.100 = 800 tok/s) = 0.2475.
#   Capacity = min(2 · 4/3, 1 · 8.08) = 8/3 req/s >= 2 ⇒ goodput = 2 req/s.
#   Colocated: a stalled gap is 0.5 + 0.021 s > 100 ms, so stalls must hit < 1 % of gaps.
#     At such loads b̄ < 1, so step = step(1) = 21 ms (clamped below the grid), and
#     f = x · 0.021 / (1 - 0.5 x) < 0.01 ⇔ x (0.021 + 0.005) < 0.01 ⇒ cap_c = 0.01/0.026 = 0.3846.
#     (Check at cap_c: k = 0.3846 · 99 / (1 - 0.1923) = 47.14, b̄ = 47.14 · 0.021 = 0.99 < 1;
#      TTFT = W(0.3846, 0.5) + 0.5 + 0.021 = 0.0595 + 0.521 = 0.58 s <= 1 s.)
#     n_c = ⌈2 / 0.3846⌉ = ⌈5.2⌉ = 6 > n_p + n_d = 3 ⇒ disaggregated.
def test_hand_checked_disaggregated_plan() -> None:
    rec = plan(linear_profile(), _workload())
    dis = rec.disaggregated
    assert dis is not None
    assert (dis.prefill_workers, dis.decode_workers) == (2, 1)
    assert dis.max_batch == 80
    b = 3.96 / 0.802
    assert dis.batch == pytest.approx(b, rel=1e-9)
    assert dis.itl_s == pytest.approx(0.020 + 0.001 * b, rel=1e-9)
    assert dis.prefill_s == pytest.approx(0.5)
    assert dis.queue_s == pytest.approx(0.25)
    assert dis.transfer_s == 0.0
    assert dis.ttft_s == pytest.approx(0.75)
    assert dis.prefill_utilisation == pytest.approx(0.5)
    assert dis.decode_utilisation == pytest.approx(0.2475)
    assert dis.capacity == pytest.approx(8 / 3)
    assert dis.goodput == pytest.approx(2.0)

    col = rec.colocated
    assert col is not None
    cap_c = 0.01 / 0.026
    assert col.workers == 6
    assert col.capacity == pytest.approx(6 * cap_c, rel=1e-9)
    assert col.goodput == pytest.approx(2.0)
    assert col.stall_gap_s == pytest.approx(0.521)
    assert col.stalled_fraction < 0.01

    assert rec.verdict is Mode.DISAGGREGATED
    assert rec.meets_slos
    assert rec.context_tokens == 1050
    assert any("colocated needs 6 workers" in r for r in rec.reasons)
    assert any("beyond the profiled batches" in w for w in rec.warnings)


def test_verdict_flips_to_colocated_when_the_load_is_low() -> None:
    # λ = 0.2: disaggregated needs 1 + 1 (ρ_p = 0.2 · 0.5 = 10 %); a colocated worker takes
    # up to 0.3846 req/s (above), so one suffices: 1 <= 2 ⇒ colocated.
    high = plan(linear_profile(), _workload(rate=2.0))
    low = plan(linear_profile(), _workload(rate=0.2))
    assert high.verdict is Mode.DISAGGREGATED
    assert low.verdict is Mode.COLOCATED
    assert low.colocated is not None and low.colocated.workers == 1
    assert low.disaggregated is not None and low.disaggregated.workers == 2
    assert low.meets_slos
    assert any("busy 10% of the time" in r for r in low.reasons)


def test_verdict_flips_to_colocated_when_a_prefill_stall_fits_the_itl_slo() -> None:
    # P = 100 at the same λ = 2: S = 0.25 · 100/500 = 0.05 s (proportional below the grid).
    # Disaggregated: n_p = 1 (ρ* = 1.9/1.95), b_max = 80, cap_d = 8.08 ⇒ n_d = 1: 2 workers.
    # One colocated worker: k = 2 · 99 / (1 - 0.1) = 220, b = 220 (0.02 + 0.001 b) ⇒
    # b = 4.4 / 0.78 = 5.641, step = 25.64 ms, stalled gap 75.64 ms <= 100 ms (ITL met on
    # every gap), TTFT = 0.1 · 0.05 / 1.8 + 0.05 + 0.02564 = 78.4 ms ⇒ 1 worker <= 2.
    long = plan(linear_profile(), _workload(prompt_tokens=1000))
    short = plan(linear_profile(), _workload(prompt_tokens=100))
    assert long.verdict is Mode.DISAGGREGATED
    assert short.verdict is Mode.COLOCATED
    col = short.colocated
    assert col is not None and col.workers == 1
    assert col.batch == pytest.approx(4.4 / 0.78, rel=1e-9)
    assert col.stall_gap_s == pytest.approx(0.05 + 0.020 + 0.001 * 4.4 / 0.78, rel=1e-9)
    assert col.itl_p99_s == pytest.approx(col.stall_gap_s)  # stalls hit > 1 % of gaps
    assert col.ttft_s == pytest.approx(0.1 * 0.05 / 1.8 + col.stall_gap_s, rel=1e-9)
    assert short.disaggregated is not None and short.disaggregated.workers == 2
    assert any("fits the ITL SLO" in r for r in short.reasons)


def test_worker_budget_limits_goodput() -> None:
    # 2 workers: disaggregated 1 + 1 serves min(4/3, 8.08) = 4/3 req/s; at that load
    # ρ = 2/3, W = (2/3)(0.5) / (2/3) = 0.5 s, TTFT = 1.0 s (= the SLO). Colocated serves
    # 2 · 0.3846 = 0.769 req/s. Neither serves 2 req/s; disaggregated has the higher goodput.
    rec = plan(linear_profile(), _workload(max_workers=2))
    dis = rec.disaggregated
    assert dis is not None and (dis.prefill_workers, dis.decode_workers) == (1, 1)
    assert dis.goodput == pytest.approx(4 / 3)
    assert dis.ttft_s == pytest.approx(1.0)
    assert rec.colocated is not None
    assert rec.colocated.goodput == pytest.approx(2 * 0.01 / 0.026, rel=1e-9)
    assert rec.verdict is Mode.DISAGGREGATED
    assert not rec.meets_slos
    # One worker cannot run disaggregated at all.
    solo = plan(linear_profile(), _workload(max_workers=1))
    assert solo.disaggregated is None
    assert solo.verdict is Mode.COLOCATED
    assert solo.chosen.goodput == pytest.approx(0.01 / 0.026, rel=1e-9)


def test_colocated_impossible_when_prefill_plus_a_step_exceeds_the_ttft_slo() -> None:
    # T = 0.51 s: disaggregated TTFT can reach 0.5 s + queueing; colocated needs >= 0.521 s.
    rec = plan(linear_profile(), _workload(slo_ttft_s=0.51))
    assert rec.colocated is None
    assert rec.verdict is Mode.DISAGGREGATED
    assert rec.disaggregated is not None and rec.disaggregated.ttft_s <= 0.51
    assert any("colocated cannot meet the TTFT SLO" in r for r in rec.reasons)


def test_kv_transfer_adds_its_exposed_tail_to_ttft() -> None:
    # t_x = 1000 · 40,000 B / 4e9 B/s = 10 ms; L = 10; X = max(1 ms, 10 - 500 · 9/10 ms) = 1 ms.
    # slack = 1 - 0.5 - 0.001 = 0.499, ρ* = 0.998 / 1.498 = 0.6662 ⇒ n_p = ⌈1.5011⌉ = 2 still;
    # TTFT = 0.25 + 0.5 + 0.001.
    prof = linear_profile(kv_bytes_per_token=40_000, num_layers=10, transfer_bytes_per_s=4e9)
    rec = plan(prof, _workload())
    assert rec.disaggregated is not None
    assert rec.disaggregated.transfer_s == pytest.approx(0.001)
    assert rec.disaggregated.ttft_s == pytest.approx(0.751)
    assert not any("no KV transfer figures" in w for w in rec.warnings)


def test_exposed_transfer_formula() -> None:
    assert exposed_transfer_s(None, 0.5, 10) == 0.0
    assert exposed_transfer_s(0.01, 0.5, None) == 0.01  # no layer count: no overlap
    assert exposed_transfer_s(0.01, 0.5, 10) == pytest.approx(0.001)  # last layer only
    assert exposed_transfer_s(1.0, 0.5, 10) == pytest.approx(1.0 - 0.45)  # link-bound


def test_md1_wait_and_batch_helpers() -> None:
    assert md1_wait(1.0, 0.5) == pytest.approx(0.25)
    assert md1_wait(0.5, 0.5) == pytest.approx(0.25 * 0.5 / 1.5)
    assert md1_wait(2.0, 0.5) == math.inf

    def step(b: float) -> float:
        return 0.020 + 0.001 * b

    assert max_batch_within(step, 0.100, 256) == 80
    assert max_batch_within(step, 0.100, 50) == 50
    assert max_batch_within(step, 0.015, 256) == 0
    assert running_batch(step, 0.0, 80) == 0.0
    assert running_batch(step, 198.0, 80) == pytest.approx(3.96 / 0.802, rel=1e-9)
    assert running_batch(step, 1000.0, 80) is None  # 1000 · 0.1 = 100 > 80


def test_single_token_outputs_have_no_itl_constraint() -> None:
    # O = 1: no inter-token gaps, so even a 1 ms ITL SLO is met; one decode worker receives.
    rec = plan(linear_profile(), _workload(output_tokens=1, slo_itl_s=0.001))
    assert rec.disaggregated is not None and rec.disaggregated.decode_workers == 1
    assert rec.disaggregated.itl_s == 0.0
    assert rec.colocated is not None and rec.colocated.stalled_fraction == 0.0


def test_infeasible_slos_raise() -> None:
    with pytest.raises(InfeasibleError, match="batch 1"):
        plan(linear_profile(), _workload(slo_itl_s=0.015))
    with pytest.raises(InfeasibleError, match="TTFT SLO"):
        plan(linear_profile(), _workload(slo_ttft_s=0.4))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rate", -1.0),
        ("rate", 0.0),
        ("rate", float("nan")),
        ("prompt_tokens", 0),
        ("output_tokens", 0),
        ("output_tokens", True),
        ("slo_ttft_s", 0.0),
        ("slo_itl_s", -0.1),
        ("max_workers", 0),
        ("max_batch", 0),
    ],
)
def test_workload_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(PlanError):
        _workload(**{field: value})


def test_recommendation_to_dict_is_plain_data() -> None:
    out = plan(linear_profile(), _workload()).to_dict()
    assert out["verdict"] == "disaggregated"
    assert out["meets_slos"] is True
    assert out["disaggregated"]["workers"] == 3
    assert out["colocated"]["workers"] == 6
    assert out["workload"]["rate"] == 2.0


def test_a_tie_in_workers_goes_to_colocated_and_names_the_headroom() -> None:
    # λ = 0.7: colocated needs ⌈0.7 / 0.3846⌉ = 2 workers (capacity 0.769 req/s); disaggregated
    # 1 + 1 (capacity min(4/3, 8.08) = 1.333 req/s). 2 <= 2 ⇒ colocated, at 0.7/0.769 = 91 %.
    rec = plan(linear_profile(), _workload(rate=0.7))
    assert rec.verdict is Mode.COLOCATED
    assert rec.colocated is not None and rec.colocated.workers == 2
    assert rec.colocated.utilisation == pytest.approx(0.7 / (2 * 0.01 / 0.026), rel=1e-9)
    assert rec.disaggregated is not None and rec.disaggregated.workers == 2
    assert any("disaggregated has more headroom" in r and "91%" in r for r in rec.reasons)


def test_local_prefill_limit_keeps_the_step_that_computes_it_within_the_itl_slo() -> None:
    # prefill(s) = s / 2000 s; at a vanishing rate the batch is ~0, taken as 1: step 21 ms.
    # prefill(s) + 0.021 <= 0.100  <=>  s <= 158.
    rec = plan(linear_profile(), _workload(rate=1e-6))
    assert rec.disaggregated is not None
    assert rec.disaggregated.local_prefill_max_tokens == 158
    assert local_prefill_limit(lambda s: s / 2000, 0.021, 0.100, cap=100) == 100  # the prompt
    assert local_prefill_limit(lambda s: s / 2000, 0.100, 0.100, cap=1000) == 0
    # One output token: no gaps to protect, and none to gain.
    one = plan(linear_profile(), _workload(output_tokens=1))
    assert one.disaggregated is not None and one.disaggregated.local_prefill_max_tokens == 0

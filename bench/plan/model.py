"""Sizing advice for disaggregated serving: pure functions from a profile and a workload to
a recommendation. No I/O here; ``bench/plan/cli.py`` reads files and prints.

Notation. Workload: request rate λ (req/s, Poisson arrivals), P prompt tokens, O output
tokens, SLOs T (time to first token) and I (inter-token latency), optional worker budget N,
batch cap B (``max_batch``, default 256). Profile (``bench/plan/profile.py``): prefill(P),
step(b, c), transfer figures. Every worker is one engine process on the profile's threads.

    S    = prefill(P)              one prompt's prefill seconds (uncached, no chunking)
    G    = O - 1                   decode steps per request (token 0 comes from the prefill)
    c̄    = P + O / 2               tokens per sequence, averaged over a running batch: in
                                   steady state the sequences are spread evenly over their
                                   progress, so a batch costs what b sequences at c̄ cost
    step(b) = step(b, c̄)
    b_max = the largest integer b <= B with step(b') <= I for every b' <= b: the decode batch
            that keeps every step under the ITL SLO. b_max = 0 (step(1) > I) is infeasible
            for any deployment (``InfeasibleError``); with O = 1 there are no gaps and the
            ITL SLO does not apply.
    W(x, S) = ρ S / (2 (1 - ρ)), ρ = x S
                                   mean wait of an M/D/1 queue: Poisson arrivals at x/s,
                                   deterministic service S, one server (Pollaczek-Khinchine
                                   with zero service variance). TTFTs below are means.

Disaggregated (n_p prefill workers, n_d decode workers; arrivals split evenly at random,
so each prefill worker is an M/D/1 queue with rate λ/n_p):

    KV transfer: t_x = P · kv_bytes_per_token / transfer_bytes_per_s; it overlaps the
    prefill layer by layer (layer i's KV is ready at (i+1) S / L, one sender moves layers in
    order), so the part after the prefill ends is
        X = max(t_x / L, t_x - S (L - 1) / L)          (X = t_x without L; 0 without t_x).
    The sender runs beside the engine (``job.finish`` is off the engine thread), so the
    prefill worker's service time stays S.
    TTFT_d = W(λ/n_p, S) + S + X
    TTFT_d <= T  ⟺  ρ_p <= ρ* = 2 s / (S + 2 s),  slack s = T - S - X   (s <= 0: infeasible)
    cap_p = ρ* / S                  req/s one prefill worker takes within the TTFT SLO
    cap_d = b_max / (G · step(b_max))  req/s one decode worker takes within the ITL SLO
                                    (∞ when G = 0)
    n_p = ⌈λ / cap_p⌉,  n_d = max(1, ⌈λ / cap_d⌉)
    With a budget N < n_p + n_d: the split n_p + n_d = N maximising min(n_p cap_p, n_d cap_d)
    (fewest prefill workers on a tie); N < 2 cannot run disaggregated.
    capacity C_d = min(n_p cap_p, n_d cap_d);  goodput = min(λ, C_d)
    Goodput counts requests that meet both SLOs. Above capacity the scheduler's admission
    control sheds the excess (RESOURCE_EXHAUSTED), so the admitted rate x = goodput meets
    both SLOs; the figures below are at x.
    running batch b̄ per decode worker: b = (x / n_d) · G · step(b)    (Little's law: batch
    = arrival rate × time in decode)
    ITL_d = step(b̄)  on every gap (no prefill ever stalls a decode worker)
    prefill utilisation ρ_p = x S / n_p;  decode utilisation u_d = (x / n_d) G step(b_max) / b_max
    (the share of the worker's token rate at b_max that is used)
    local prefill limit L = the largest s <= P with prefill(s) + step(max(b̄, 1)) <= I: a
    request whose uncached part is at most L tokens may be prefilled on its decode worker
    (the scheduler's --local-prefill-max-tokens) and the one step that computes it still
    fits the ITL SLO (no gaps: L = 0, nothing to protect or to gain)

Colocated (n_c workers, each doing both phases with continuous batching and no chunked
prefill; a waiting prompt is prefilled before the next decode step; rate x = λ / n_c each):

    prefill takes x S of each second; decode steps fill the rest, so the running batch b̄
    solves b = k · step(b), k = x G / (1 - x S), and must stay <= b_max (capacity: x S < 1)
    every prefill stalls every running stream once: the stalled gap is S + step(b̄), and the
    share of a stream's gaps that hold a stall is
        f = x · mean gap = x step(b̄) / (1 - x S)
    The ITL SLO is read as a P99 bound:
        P99 ITL_c = S + step(b̄)   if f >= 1 %,  else step(b̄)
    so a colocated worker meets the ITL SLO when a stalled gap itself fits (S + step <= I),
    or when stalls hit fewer than 1 % of the gaps. (Gaps holding two prefills are ignored.)
    TTFT_c = W(x, S) + S + step(b̄)   (queued prompts, the prefill, and at most one running
    decode step that the prompt waits for)
    cap_c = the largest x meeting both SLOs and capacity (bisection: every condition
    worsens as x grows); n_c = ⌈λ / cap_c⌉ (at most N); goodput = min(λ, n_c cap_c).
    No KV moves, and each worker's cores serve both phases.

Verdict. Colocated is the better choice when it serves λ within both SLOs with no more
workers than disaggregation needs (n_c <= n_p + n_d; a tie goes to colocated: no transfer,
one pool to run), or when only colocated serves λ. Otherwise disaggregated. When neither
serves λ within the budget, the one with the higher goodput (a tie goes to colocated). A
dedicated prefill worker busy less than half the time is given as a further reason for
colocated (the load is too low to keep it busy); on a tie in workers where disaggregated has
the higher capacity, the reasons say so (colocated then has less headroom).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from bench.plan.profile import Profile

DEFAULT_MAX_BATCH = 256
STALL_P99_SHARE = 0.01  # stalls in fewer than this share of gaps leave P99 ITL alone
LOW_PREFILL_UTILISATION = 0.5
_REL_TOL = 1e-9  # floating slack when comparing a computed figure with an SLO or a rate


class PlanError(ValueError):
    """The workload (or the budget) is not a valid question."""


class InfeasibleError(PlanError):
    """No deployment of this profile meets the SLOs, whatever the load or worker count."""


class Mode(StrEnum):
    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"


@dataclass(frozen=True)
class Workload:
    """The traffic to serve and its SLOs (seconds). ``max_workers`` bounds both modes."""

    rate: float
    prompt_tokens: int
    output_tokens: int
    slo_ttft_s: float
    slo_itl_s: float
    max_workers: int | None = None
    max_batch: int = DEFAULT_MAX_BATCH

    def __post_init__(self) -> None:
        def number(value: object) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        def integer(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not number(self.rate) or not math.isfinite(self.rate) or self.rate <= 0:
            raise PlanError(f"rate must be a positive number of requests/s, got {self.rate!r}")
        for name in ("prompt_tokens", "output_tokens", "max_batch"):
            value = getattr(self, name)
            if not integer(value) or value < 1:
                raise PlanError(f"{name.replace('_', ' ')} must be an integer >= 1, got {value!r}")
        for name, label in (("slo_ttft_s", "TTFT SLO"), ("slo_itl_s", "ITL SLO")):
            value = getattr(self, name)
            if not number(value) or not math.isfinite(value) or value <= 0:
                raise PlanError(f"{label} must be a positive number of seconds, got {value!r}")
        if self.max_workers is not None and (not integer(self.max_workers) or self.max_workers < 1):
            raise PlanError(f"max workers must be an integer >= 1, got {self.max_workers!r}")


@dataclass(frozen=True)
class DisaggregatedPlan:
    """Separate prefill and decode pools; figures at the served rate ``goodput``."""

    prefill_workers: int
    decode_workers: int
    max_batch: int  # b_max: the largest decode batch whose step fits the ITL SLO
    batch: float  # b̄: mean running batch per decode worker at the served rate
    itl_s: float  # step(b̄): every inter-token gap
    prefill_s: float
    queue_s: float  # mean wait for a prefill worker (M/D/1)
    transfer_s: float  # KV transfer left after the prefill ends
    ttft_s: float
    prefill_utilisation: float
    decode_utilisation: float
    capacity: float  # req/s these workers serve within both SLOs
    goodput: float
    local_prefill_max_tokens: int = 0  # L: what a decode worker may prefill itself

    @property
    def workers(self) -> int:
        return self.prefill_workers + self.decode_workers


@dataclass(frozen=True)
class ColocatedPlan:
    """Workers that do both phases; figures at the served rate ``goodput``."""

    workers: int
    max_batch: int
    batch: float
    step_s: float  # a decode step without a stall
    stall_gap_s: float  # a gap holding a prefill: S + step
    stalled_fraction: float  # f: share of inter-token gaps that hold a prefill
    itl_p99_s: float
    prefill_s: float
    queue_s: float
    ttft_s: float
    prefill_busy: float  # x S: share of each worker's time spent prefilling
    utilisation: float  # per-worker rate / cap_c
    capacity: float
    goodput: float


@dataclass(frozen=True)
class Recommendation:
    """The verdict with both alternatives; a mode is None when no worker count of it meets
    the SLOs even at a vanishing load (or, disaggregated, when the budget is below 2)."""

    workload: Workload
    verdict: Mode
    reasons: tuple[str, ...]
    warnings: tuple[str, ...]
    context_tokens: float  # c̄
    disaggregated: DisaggregatedPlan | None
    colocated: ColocatedPlan | None

    @property
    def chosen(self) -> DisaggregatedPlan | ColocatedPlan:
        plan = self.colocated if self.verdict is Mode.COLOCATED else self.disaggregated
        assert plan is not None
        return plan

    @property
    def meets_slos(self) -> bool:
        """Whether the chosen deployment serves the whole rate within both SLOs."""
        return _serves(self.chosen.goodput, self.workload.rate)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["verdict"] = self.verdict.value
        out["meets_slos"] = self.meets_slos
        if self.disaggregated is not None:
            out["disaggregated"]["workers"] = self.disaggregated.workers
        return out


# -- the pieces (pure) --------------------------------------------------------------------
def md1_wait(arrival_rate: float, service_s: float) -> float:
    """Mean queueing delay of an M/D/1 queue: ρ S / (2 (1 - ρ)), ρ = rate · S; ∞ at ρ >= 1."""
    rho = arrival_rate * service_s
    if rho >= 1.0:
        return math.inf
    return rho * service_s / (2.0 * (1.0 - rho))


def exposed_transfer_s(transfer_s: float | None, prefill_s: float, layers: int | None) -> float:
    """KV transfer time left after the prefill ends, for a layer-by-layer push."""
    if transfer_s is None:
        return 0.0
    if layers is None:
        return transfer_s
    return max(transfer_s / layers, transfer_s - prefill_s * (layers - 1) / layers)


def max_batch_within(step: Callable[[float], float], limit_s: float, cap: int) -> int:
    """The largest b <= cap with step(b') <= limit for every integer b' <= b (0 if none)."""
    best = 0
    for b in range(1, cap + 1):
        if step(b) > limit_s * (1 + _REL_TOL):
            break
        best = b
    return best


def local_prefill_limit(
    prefill: Callable[[float], float], step_s: float, limit_s: float, cap: int
) -> int:
    """The largest s <= cap with prefill(s) + step_s <= limit_s (0 if none): the uncached
    tokens a decode worker may prefill in place while the step that computes them still
    fits the ITL SLO. ``prefill`` must increase with s."""
    lo, hi = 0, cap
    if prefill(1) + step_s > limit_s * (1 + _REL_TOL):
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if prefill(mid) + step_s <= limit_s * (1 + _REL_TOL):
            lo = mid
        else:
            hi = mid - 1
    return lo


def running_batch(step: Callable[[float], float], k: float, cap: float) -> float | None:
    """The mean running batch b solving b = k · step(b) (Little's law), or None when it
    exceeds ``cap``. ``k`` is requests/s × decode steps per request (0: empty batch)."""
    if k <= 0:
        return 0.0
    if cap - k * step(cap) < -_REL_TOL * cap:
        return None
    lo, hi = 0.0, float(cap)
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid - k * step(mid) >= 0:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    return hi


def _ceil(x: float) -> int:
    """⌈x⌉ that forgives floating noise just above an integer."""
    return max(0, math.ceil(x * (1 - _REL_TOL)))


def _serves(goodput: float, rate: float) -> bool:
    return goodput >= rate * (1 - _REL_TOL)


# -- disaggregated ------------------------------------------------------------------------
@dataclass(frozen=True)
class _Inputs:
    workload: Workload
    prefill_s: float
    gaps: int  # G
    context: float  # c̄
    step: Callable[[float], float]
    b_max: int
    transfer_s: float  # X
    prefill: Callable[[float], float]  # prefill(P) of the profile


def _disaggregated(inp: _Inputs) -> DisaggregatedPlan | None:
    wl, s = inp.workload, inp.prefill_s
    slack = wl.slo_ttft_s - s - inp.transfer_s
    if slack <= 0 or (wl.max_workers is not None and wl.max_workers < 2):
        return None
    cap_p = (2 * slack / (s + 2 * slack)) / s
    cap_d = math.inf if inp.gaps == 0 else inp.b_max / (inp.gaps * inp.step(inp.b_max))
    n_p = max(1, _ceil(wl.rate / cap_p))
    n_d = 1 if inp.gaps == 0 else max(1, _ceil(wl.rate / cap_d))
    if wl.max_workers is not None and n_p + n_d > wl.max_workers:
        budget = wl.max_workers
        n_p = max(range(1, budget), key=lambda p: (min(p * cap_p, (budget - p) * cap_d), -p))
        n_d = budget - n_p
    capacity = min(n_p * cap_p, n_d * cap_d)
    served = min(wl.rate, capacity)
    queue = md1_wait(served / n_p, s)
    k = served / n_d * inp.gaps
    batch = running_batch(inp.step, k, inp.b_max)
    assert batch is not None, "served <= n_d cap_d keeps the batch within b_max"
    itl = inp.step(batch) if inp.gaps else 0.0
    decode_util = 0.0 if inp.gaps == 0 else k * inp.step(inp.b_max) / inp.b_max
    return DisaggregatedPlan(
        prefill_workers=n_p,
        decode_workers=n_d,
        max_batch=inp.b_max,
        batch=batch,
        itl_s=itl,
        prefill_s=s,
        queue_s=queue,
        transfer_s=inp.transfer_s,
        ttft_s=queue + s + inp.transfer_s,
        prefill_utilisation=served * s / n_p,
        decode_utilisation=decode_util,
        capacity=capacity,
        goodput=served,
        local_prefill_max_tokens=0
        if inp.gaps == 0
        else local_prefill_limit(
            inp.prefill, inp.step(max(batch, 1.0)), inp.workload.slo_itl_s, wl.prompt_tokens
        ),
    )


# -- colocated ----------------------------------------------------------------------------
@dataclass(frozen=True)
class _ColocatedState:
    batch: float
    step_s: float
    stalled_fraction: float
    itl_p99_s: float
    queue_s: float
    ttft_s: float

    def meets(self, wl: Workload) -> bool:
        return self.ttft_s <= wl.slo_ttft_s * (1 + _REL_TOL) and self.itl_p99_s <= wl.slo_itl_s * (
            1 + _REL_TOL
        )


def _colocated_at(inp: _Inputs, x: float) -> _ColocatedState | None:
    """One colocated worker at x req/s, or None when it cannot keep up at all."""
    s = inp.prefill_s
    if x * s >= 1.0:
        return None
    k = x * inp.gaps / (1.0 - x * s)
    batch = running_batch(inp.step, k, inp.b_max)
    if batch is None:
        return None
    step = inp.step(batch) if inp.gaps else 0.0
    stalled = x * step / (1.0 - x * s) if inp.gaps else 0.0
    p99 = s + step if stalled >= STALL_P99_SHARE else step
    queue = md1_wait(x, s)
    return _ColocatedState(batch, step, stalled, p99, queue, queue + s + step)


def _colocated_capacity(inp: _Inputs) -> float:
    """cap_c: the largest per-worker rate meeting both SLOs (0 when none does)."""
    wl = inp.workload
    at_zero = _colocated_at(inp, 0.0)
    if at_zero is None or not at_zero.meets(wl):
        return 0.0
    lo, hi = 0.0, 1.0 / inp.prefill_s
    for _ in range(200):
        mid = (lo + hi) / 2
        state = _colocated_at(inp, mid)
        if state is not None and state.meets(wl):
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return lo


def _colocated(inp: _Inputs) -> ColocatedPlan | None:
    wl = inp.workload
    cap = _colocated_capacity(inp)
    if cap <= 0:
        return None
    workers = max(1, _ceil(wl.rate / cap))
    if wl.max_workers is not None:
        workers = min(workers, wl.max_workers)
    served = min(wl.rate, workers * cap)
    x = served / workers
    state = _colocated_at(inp, x)
    assert state is not None, "x <= cap_c keeps a colocated worker within capacity"
    return ColocatedPlan(
        workers=workers,
        max_batch=inp.b_max,
        batch=state.batch,
        step_s=state.step_s,
        stall_gap_s=inp.prefill_s + state.step_s,
        stalled_fraction=state.stalled_fraction,
        itl_p99_s=state.itl_p99_s,
        prefill_s=inp.prefill_s,
        queue_s=state.queue_s,
        ttft_s=state.ttft_s,
        prefill_busy=x * inp.prefill_s,
        utilisation=x / cap,
        capacity=workers * cap,
        goodput=served,
    )


# -- the plan -----------------------------------------------------------------------------
def plan(profile: Profile, workload: Workload) -> Recommendation:
    """Size both deployments for ``workload`` on ``profile`` and say which to run.

    Raises ``InfeasibleError`` when neither mode meets the SLOs at any load: the decode step
    at batch 1 exceeds the ITL SLO, or the prefill (plus transfer / one decode step)
    exceeds the TTFT SLO.
    """
    wl = workload
    s = profile.prefill_seconds(wl.prompt_tokens)
    gaps = wl.output_tokens - 1
    context = wl.prompt_tokens + wl.output_tokens / 2

    def step(b: float) -> float:
        return profile.decode_step_seconds(b, context)

    if gaps == 0:
        b_max = wl.max_batch  # no inter-token gaps: the ITL SLO does not bind
    else:
        b_max = max_batch_within(step, wl.slo_itl_s, wl.max_batch)
        if b_max == 0:
            raise InfeasibleError(
                f"the ITL SLO ({_ms(wl.slo_itl_s)}) is below one decode step even at batch 1 "
                f"({_ms(step(1))} at {context:.0f} tokens of context): no deployment meets it"
            )
    exposed = exposed_transfer_s(profile.transfer_seconds(wl.prompt_tokens), s, profile.num_layers)
    inp = _Inputs(wl, s, gaps, context, step, b_max, exposed, profile.prefill_seconds)
    dis = _disaggregated(inp)
    col = _colocated(inp)
    if dis is None and col is None:
        raise InfeasibleError(_infeasible_ttft(inp))
    verdict, reasons = _verdict(inp, dis, col)
    return Recommendation(
        workload=wl,
        verdict=verdict,
        reasons=tuple(reasons),
        warnings=tuple(_warnings(profile, inp)),
        context_tokens=context,
        disaggregated=dis,
        colocated=col,
    )


def _infeasible_ttft(inp: _Inputs) -> str:
    wl = inp.workload
    if wl.max_workers is not None and wl.max_workers < 2:
        why = f"disaggregation needs 2 workers (budget {wl.max_workers})"
    else:
        why = (
            f"disaggregated TTFT is at least prefill {_ms(inp.prefill_s)} + KV transfer "
            f"{_ms(inp.transfer_s)}"
        )
    return (
        f"the TTFT SLO ({_ms(wl.slo_ttft_s)}) cannot be met at any load: a "
        f"{wl.prompt_tokens}-token prefill takes {_ms(inp.prefill_s)}; {why}; colocated TTFT "
        f"is at least prefill + one decode step ({_ms(inp.prefill_s + inp.step(1))})"
    )


def _verdict(
    inp: _Inputs, dis: DisaggregatedPlan | None, col: ColocatedPlan | None
) -> tuple[Mode, list[str]]:
    wl = inp.workload
    d_ok = dis is not None and _serves(dis.goodput, wl.rate)
    c_ok = col is not None and _serves(col.goodput, wl.rate)
    reasons: list[str] = []
    if col is not None and c_ok and (not d_ok or (dis is not None and col.workers <= dis.workers)):
        if dis is not None and d_ok:
            reasons.append(
                f"colocated meets both SLOs at {wl.rate:g} req/s with {col.workers} worker(s), "
                f"no more than disaggregation needs ({dis.prefill_workers} prefill + "
                f"{dis.decode_workers} decode), and moves no KV"
            )
            solo = inp.prefill_s * wl.rate / dis.prefill_workers
            if solo < LOW_PREFILL_UTILISATION:
                reasons.append(
                    f"the load is too low to keep a dedicated prefill worker busy: it would "
                    f"be busy {solo:.0%} of the time"
                )
            if col.workers == dis.workers and dis.capacity > col.capacity:
                reasons.append(
                    f"note: with the same {col.workers} workers disaggregated has more headroom "
                    f"({dis.capacity:.3g} req/s within the SLOs against {col.capacity:.3g}; "
                    f"colocated runs at {col.utilisation:.0%} of its capacity)"
                )
        else:
            reasons.append(
                f"colocated meets both SLOs at {wl.rate:g} req/s with {col.workers} "
                f"worker(s); {_why_not_disaggregated(inp, dis)}"
            )
        reasons.append(_stall_reason(inp, col))
        return Mode.COLOCATED, reasons
    if dis is not None and d_ok:
        reasons.append(
            f"disaggregated meets both SLOs at {wl.rate:g} req/s with {dis.prefill_workers} "
            f"prefill + {dis.decode_workers} decode workers; decode steps stay uniform "
            f"({_ms(dis.itl_s)}) because no prefill runs on a decode worker"
        )
        reasons.append(_why_not_colocated(inp, col, dis))
        return Mode.DISAGGREGATED, reasons
    # Neither serves the whole rate (only possible under a worker budget).
    d_good = 0.0 if dis is None else dis.goodput
    c_good = 0.0 if col is None else col.goodput
    budget = f"with at most {wl.max_workers} worker(s)"
    reasons.append(
        f"{budget} neither mode serves {wl.rate:g} req/s within both SLOs: disaggregated "
        f"serves {d_good:.3g} req/s, colocated {c_good:.3g} req/s; the rest would be shed"
    )
    if col is not None and c_good >= d_good * (1 - _REL_TOL):
        return Mode.COLOCATED, reasons
    return Mode.DISAGGREGATED, reasons


def _why_not_disaggregated(inp: _Inputs, dis: DisaggregatedPlan | None) -> str:
    wl = inp.workload
    if dis is None:
        if wl.max_workers is not None and wl.max_workers < 2:
            return f"disaggregation needs at least 2 workers (budget {wl.max_workers})"
        return (
            f"disaggregated cannot meet the TTFT SLO: prefill {_ms(inp.prefill_s)} + KV "
            f"transfer {_ms(inp.transfer_s)} > {_ms(wl.slo_ttft_s)}"
        )
    return (
        f"disaggregated serves only {dis.goodput:.3g} req/s within the budget of "
        f"{wl.max_workers} worker(s)"
    )


def _stall_reason(inp: _Inputs, col: ColocatedPlan) -> str:
    wl = inp.workload
    if inp.gaps == 0:
        return "requests produce one token, so prefill stalls cannot hurt inter-token latency"
    if col.stall_gap_s <= wl.slo_itl_s * (1 + _REL_TOL):
        return (
            f"a prefill stall plus a decode step ({_ms(col.stall_gap_s)}) fits the ITL SLO "
            f"({_ms(wl.slo_itl_s)})"
        )
    return (
        f"prefill stalls ({_ms(col.stall_gap_s)} gaps) exceed the ITL SLO but hit only "
        f"{col.stalled_fraction:.2%} of inter-token gaps (< {STALL_P99_SHARE:.0%}), so P99 ITL "
        f"stays {_ms(col.itl_p99_s)}"
    )


def _why_not_colocated(inp: _Inputs, col: ColocatedPlan | None, dis: DisaggregatedPlan) -> str:
    wl = inp.workload
    stall = inp.prefill_s + inp.step(1)
    if col is None:
        if stall > wl.slo_ttft_s:
            return (
                f"colocated cannot meet the TTFT SLO at any load: prefill + one decode step "
                f"= {_ms(stall)} > {_ms(wl.slo_ttft_s)}"
            )
        return "colocated cannot meet both SLOs at any load"
    if not _serves(col.goodput, wl.rate):
        return (
            f"colocated serves only {col.goodput:.3g} req/s within both SLOs with "
            f"{col.workers} worker(s)"
        )
    per_worker = col.capacity / col.workers
    if col.stall_gap_s > wl.slo_itl_s:
        limit = (
            f"each {wl.prompt_tokens}-token prefill stalls every running stream for "
            f"{_ms(inp.prefill_s)} (a {_ms(col.stall_gap_s)} gap > ITL SLO "
            f"{_ms(wl.slo_itl_s)}), so a colocated worker must keep stalls under "
            f"{STALL_P99_SHARE:.0%} of gaps"
        )
    else:
        limit = "prefill and decode share each colocated worker's time"
    return (
        f"colocated needs {col.workers} workers (> {dis.workers}): {limit}, which caps it at "
        f"{per_worker:.3g} req/s per worker"
    )


def _warnings(profile: Profile, inp: _Inputs) -> list[str]:
    wl = inp.workload
    out: list[str] = []
    if wl.prompt_tokens > profile.prefill_tokens[-1]:
        out.append(
            f"the prompt ({wl.prompt_tokens} tokens) is longer than the longest profiled "
            f"prefill ({profile.prefill_tokens[-1]}): prefill time is extrapolated "
            "proportionally and likely underestimated"
        )
    if inp.context > profile.decode_contexts[-1]:
        out.append(
            f"the mean decode context ({inp.context:.0f} tokens) is beyond the profiled "
            f"contexts (up to {profile.decode_contexts[-1]}): step times are extrapolated"
        )
    if inp.gaps and inp.b_max > profile.decode_batches[-1]:
        out.append(
            f"the ITL-bound batch ({inp.b_max}) is beyond the profiled batches (up to "
            f"{profile.decode_batches[-1]}): step times are extrapolated linearly"
        )
    if inp.gaps and inp.b_max == wl.max_batch:
        out.append(f"the decode batch is capped by --max-batch {wl.max_batch}, not the ITL SLO")
    if profile.transfer_seconds(wl.prompt_tokens) is None:
        out.append("the profile has no KV transfer figures: transfer time is counted as 0")
    out.append("KV memory per decode worker is not modelled: check the batch fits its KV pool")
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"

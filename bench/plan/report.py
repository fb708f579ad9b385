"""The recommendation in plain words and numbers (pure: a recommendation in, text out)."""

from __future__ import annotations

from pathlib import Path

from bench.plan.model import ColocatedPlan, DisaggregatedPlan, Mode, Recommendation
from bench.plan.profile import Profile


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _rate(value: float) -> str:
    return f"{value:.3g}"


def format_recommendation(rec: Recommendation, profile: Profile) -> str:
    wl = rec.workload
    lines = [
        f"Workload: {_rate(wl.rate)} req/s, {wl.prompt_tokens} prompt + {wl.output_tokens} "
        f"output tokens; SLOs: TTFT {_ms(wl.slo_ttft_s)} (mean), ITL {_ms(wl.slo_itl_s)} (P99)"
        + ("" if wl.max_workers is None else f"; at most {wl.max_workers} workers"),
        f"Profile: {profile.threads} thread(s) per worker, "
        f"{Path(profile.model).name or 'unknown model'} {profile.dtype}"
        + (f", measured {profile.created}" if profile.created else "")
        + _load(profile),
        "",
        _headline(rec),
        "",
    ]
    if rec.disaggregated is not None:
        lines += _disaggregated_lines(rec.disaggregated, wl.rate)
    else:
        lines.append("Disaggregated: cannot meet the SLOs (see why below).")
    if rec.colocated is not None:
        lines += _colocated_lines(rec.colocated, wl.rate)
    else:
        lines.append("Colocated: cannot meet the SLOs at any load (see why below).")
    lines += ["", "Why:"] + [f"  - {r}" for r in rec.reasons]
    if rec.warnings:
        lines += ["Caveats:"] + [f"  - {w}" for w in rec.warnings]
    return "\n".join(lines)


def _load(profile: Profile) -> str:
    """The load average the profile was measured under, when it recorded one."""
    before, cpus = profile.machine.get("load_before"), profile.machine.get("cpu_count")
    if not isinstance(before, list) or not before or not isinstance(cpus, int):
        return ""
    return f" under load average {before[0]:.2f} on {cpus} CPUs"


def _headline(rec: Recommendation) -> str:
    wl = rec.workload
    plan = rec.chosen
    if isinstance(plan, DisaggregatedPlan):
        shape = (
            f"disaggregated, {plan.prefill_workers} prefill : {plan.decode_workers} decode "
            f"workers ({plan.workers} in all)"
        )
    else:
        shape = f"colocated, {plan.workers} worker(s)"
    if rec.meets_slos:
        outcome = f"serves {_rate(wl.rate)} req/s within both SLOs"
    else:
        outcome = (
            f"does NOT serve {_rate(wl.rate)} req/s within both SLOs: goodput "
            f"{_rate(plan.goodput)} req/s"
        )
    assert rec.verdict in (Mode.COLOCATED, Mode.DISAGGREGATED)
    return f"Recommendation: {shape}; {outcome}."


def _disaggregated_lines(plan: DisaggregatedPlan, rate: float) -> list[str]:
    return [
        f"Disaggregated ({plan.prefill_workers} prefill + {plan.decode_workers} decode):",
        f"  decode batch  up to {plan.max_batch} sequences per decode worker keep a step within "
        f"the ITL SLO; about {plan.batch:.1f} run at this load",
        f"  TTFT          {_ms(plan.ttft_s)} mean = prefill {_ms(plan.prefill_s)} + queueing "
        f"{_ms(plan.queue_s)} + KV transfer {_ms(plan.transfer_s)}",
        f"  ITL           {_ms(plan.itl_s)} on every gap",
        f"  goodput       {_rate(plan.goodput)} of {_rate(rate)} req/s "
        f"(capacity {_rate(plan.capacity)} req/s)",
        f"  utilisation   prefill {plan.prefill_utilisation:.0%}, "
        f"decode {plan.decode_utilisation:.0%}",
        f"  local prefill up to {plan.local_prefill_max_tokens} uncached prompt tokens on the "
        "decode worker keep that step within the ITL SLO "
        f"(--local-prefill-max-tokens {plan.local_prefill_max_tokens})",
    ]


def _colocated_lines(plan: ColocatedPlan, rate: float) -> list[str]:
    return [
        f"Colocated ({plan.workers} worker(s)):",
        f"  decode batch  up to {plan.max_batch}; about {plan.batch:.1f} run at this load",
        f"  TTFT          {_ms(plan.ttft_s)} mean = prefill {_ms(plan.prefill_s)} + queueing "
        f"{_ms(plan.queue_s)} + one decode step {_ms(plan.step_s)}",
        f"  ITL P99       {_ms(plan.itl_p99_s)} (steps {_ms(plan.step_s)}; "
        f"{plan.stalled_fraction:.2%} of gaps hold a prefill: {_ms(plan.stall_gap_s)})",
        f"  goodput       {_rate(plan.goodput)} of {_rate(rate)} req/s "
        f"(capacity {_rate(plan.capacity)} req/s)",
        f"  utilisation   prefilling {plan.prefill_busy:.0%} of the time; "
        f"{plan.utilisation:.0%} of the SLO capacity",
    ]

"""The run's report: ``PrefixReport`` (everything measured) and its markdown (pure), ready to
paste into docs/benchmarks.md under "Prefix reuse"."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from bench._common import markdown_table, mib_cell, percent_cell
from bench.prefix.targets import KvLayout, RunFigures, Target, bytes_checks, targets
from bench.prefix.workers import WorkerCounters
from bench.serve.result import BenchResult

PLOT_NAME = "prefix.png"


@dataclass(frozen=True)
class WorkloadRun:
    """One workload under one policy: every request, each worker's counter growth over the
    workload, and the figures."""

    policy: str
    workload: str
    result: BenchResult
    workers: dict[str, WorkerCounters]
    figures: RunFigures


@dataclass(frozen=True)
class PrefixReport:
    date: str
    command: str
    machine: dict[str, Any]
    config: dict[str, Any]
    layout: KvLayout
    wall_s: float
    runs: list[WorkloadRun]

    @property
    def targets(self) -> list[Target]:
        return targets([r.figures for r in self.runs])

    def to_json(self) -> dict[str, Any]:
        return {
            "date": self.date,
            "command": self.command,
            "machine": self.machine,
            "config": self.config,
            "kv_layout": asdict(self.layout),
            "wall_s": self.wall_s,
            "targets": [asdict(t) for t in self.targets],
            "runs": [
                {
                    "policy": r.policy,
                    "workload": r.workload,
                    "figures": r.figures.to_dict(),
                    "workers": {
                        w: {**asdict(c), "role": c.role, "hit_rate": c.hit_rate}
                        for w, c in r.workers.items()
                    },
                    "kv_bytes_checks": [
                        {**asdict(c), "ok": c.ok} for c in bytes_checks(r.result, self.layout)
                    ],
                    "result": r.result.to_dict(),
                }
                for r in self.runs
            ],
        }


def _n(value: float | None, fmt: str = ",.0f") -> str:
    return "-" if value is None else format(value, fmt)


def verdict(passed: bool | None) -> str:
    return {True: "PASS", False: "FAIL", None: "not judged"}[passed]


RUN_HEADER = (
    "workload", "policy", "ok", "failed", "TTFT p50 ms", "later turns TTFT p50 ms",
    "E2E p50 ms", "ITL p50 / p99 ms", "prompt tok", "computed tok (requests)",
    "computed tok (workers)", "cached %", "KV MiB/req", "later turns KV MiB/req",
    "later turns within KV bound",
)  # fmt: skip
WORKER_HEADER = ("workload", "policy", "worker", "cached tok", "computed tok", "hit rate",
                 "KV MiB moved")  # fmt: skip


def run_table(runs: list[WorkloadRun]) -> str:
    rows = []
    for r in runs:
        f = r.figures
        bound = f"{f.bytes_ok}/{f.bytes_checked}" if f.bytes_checked else "-"
        rows.append([
            f.workload, f.policy, str(f.requests - f.failed), str(f.failed), _n(f.ttft_p50_ms),
            _n(f.later_ttft_p50_ms), _n(f.e2e_p50_ms),
            f"{_n(f.itl_p50_ms)} / {_n(f.itl_p99_ms)}", _n(f.prompt_tokens),
            _n(f.computed_tokens), _n(f.worker_computed),
            percent_cell(f.cached_tokens / f.prompt_tokens if f.prompt_tokens else None),
            mib_cell(f.kv_bytes_mean), mib_cell(f.later_kv_bytes_mean), bound,
        ])  # fmt: skip
    return markdown_table(RUN_HEADER, rows)


def worker_table(runs: list[WorkloadRun]) -> str:
    rows = [
        [r.workload, r.policy, c.worker, _n(c.cached), _n(c.computed), percent_cell(c.hit_rate),
         mib_cell(c.kv_bytes)]
        for r in runs
        for c in r.workers.values()
    ]  # fmt: skip
    return markdown_table(WORKER_HEADER, rows)


def target_table(found: list[Target]) -> str:
    return markdown_table(
        ("target", "measured", "verdict"), [[t.name, t.detail, verdict(t.passed)] for t in found]
    )


def _workloads(config: dict[str, Any]) -> list[str]:
    out = []
    if "multi-turn" in config["workloads"]:
        out.append(
            f"multi-turn: {config['mt_sessions']} sessions x {config['mt_turns']} turns, one "
            f"{config['mt_system_tokens']}-token system prompt, {config['mt_user_tokens']}-token "
            "user messages, each turn sent with the whole conversation so far"
        )
    if "shared-prefix" in config["workloads"]:
        out.append(
            f"shared-prefix: {config['sp_users']} users over {config['sp_system_prompts']} "
            f"system prompts of {config['sp_system_tokens']} tokens, "
            f"{config['sp_user_tokens']}-token user messages"
        )
    out.append(
        f"every request: chat, greedy, max_tokens {config['output_tokens']} (answers end where "
        f"the model ends them); {config['concurrency']} sessions (users) at once"
    )
    return out


def render(report: PrefixReport, plot: str | None = PLOT_NAME) -> str:
    """The whole report in markdown; ``plot``: the figure's file name to link (``None``:
    none)."""
    cfg, m = report.config, report.machine
    found = report.targets
    lines = [
        "### Prefix reuse: round-robin, least-loaded and cache-aware routing",
        "",
        f"- date: {report.date} (the run took {report.wall_s / 60:.1f} min)",
        f"- command: `{report.command}`",
        f"- machine: {m.get('cpu_model', '?')}, {m.get('cpu_count', '?')} cores",
        f"- stack per policy (fresh, so caches start cold): `pdserve up --prefill "
        f"{cfg['prefill']} --decode {cfg['decode']} --routing <policy> --kv-cache-mib "
        f"{cfg['kv_cache_mib']}`; KV block: {report.layout.block_size} tokens, "
        f"{report.layout.block_bytes:,} bytes over all layers",
        *(f"- {w}" for w in _workloads(cfg)),
        "",
        run_table(report.runs),
        "",
        "Per worker (counter growth over the workload; a decode worker's cached tokens are "
        "prompt tokens it already held and did not need sent):",
        "",
        worker_table(report.runs),
        "",
        target_table(found),
        "",
    ]
    if plot is not None:
        lines += [f"![TTFT and prompt tokens by routing policy]({plot})", ""]
    passed = [t.passed for t in found]
    overall = "PASS" if passed and all(p is True for p in passed) else "FAIL"
    lines.append(f"targets: {overall} ({sum(p is True for p in passed)}/{len(passed)} met)")
    return "\n".join(lines)

"""One ``bench.prefix`` run, start to stop.

Lifecycle: every policy's ``pdserve up`` flags checked -> the KV block layout read from the
checkpoint -> per policy: a fresh stack started -> per workload: conversations built (fresh
nonces, the same seed for every policy), the workers' counters read, the conversations run
(``bench.serve.session_runner``: each request has its deadline), the counters read again ->
the stack stopped (always) -> ``PrefixReport``.
"""

from __future__ import annotations

import asyncio
import datetime
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from bench.prefix.config import PrefixConfig
from bench.prefix.report import PrefixReport, WorkloadRun
from bench.prefix.stack import check_up_flags, kv_layout, running_stack, up_argv
from bench.prefix.targets import KvLayout, figures
from bench.prefix.workers import growth, read_counters
from bench.serve.result import BenchResult
from bench.serve.sessions import (
    Session,
    build_long_document,
    build_multi_turn,
    build_shared_prefix,
)
from engine.tokenizer import Tokenizer


def _say(line: str) -> None:
    print(f"bench.prefix: {line}", file=sys.stderr, flush=True)


def build_workload(cfg: PrefixConfig, workload: str, tokenizer: Tokenizer) -> list[Session]:
    """``workload``'s conversations under ``cfg`` (fresh nonces on every call)."""
    if workload == "multi-turn":
        return build_multi_turn(
            tokenizer,
            sessions=cfg.mt_sessions,
            turns=cfg.mt_turns,
            system_tokens=cfg.mt_system_tokens,
            user_tokens=cfg.mt_user_tokens,
            output_tokens=cfg.output_tokens,
            seed=cfg.seed,
        )
    if workload == "long-document":
        return build_long_document(
            tokenizer,
            sessions=cfg.ld_sessions,
            turns=cfg.ld_turns,
            min_doc_tokens=cfg.ld_min_doc_tokens,
            max_doc_tokens=cfg.ld_max_doc_tokens,
            user_tokens=cfg.ld_user_tokens,
            output_tokens=cfg.output_tokens,
            seed=cfg.seed,
        )
    return build_shared_prefix(
        tokenizer,
        system_prompts=cfg.sp_system_prompts,
        users=cfg.sp_users,
        system_tokens=cfg.sp_system_tokens,
        user_tokens=cfg.sp_user_tokens,
        output_tokens=cfg.output_tokens,
        seed=cfg.seed,
    )


def run(cfg: PrefixConfig, command: str, say: Callable[[str], None] = _say) -> PrefixReport:
    """Run ``cfg``: every policy on its own stack, started and stopped here. ``command``: the
    command line to print in the report."""
    from bench._common import machine_info
    from bench.serve.session_runner import run_sessions
    from bench.serve.workload import default_tokenizer

    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    started = time.monotonic()
    log_root = Path(cfg.log_dir or tempfile.mkdtemp(prefix="pdserve-prefix-"))
    for policy in cfg.policies:
        check_up_flags(up_argv(cfg, policy, http_port=0, grpc_port=0, log_dir=log_root))
    say("reading the KV layout from the checkpoint")
    layout: KvLayout = kv_layout()
    tokenizer = default_tokenizer()
    runs: list[WorkloadRun] = []
    for policy in cfg.policies:
        with running_stack(cfg, policy, log_root / policy, say) as endpoints:
            say(f"{policy}: up after {time.monotonic() - started:.0f} s into the run")
            for workload in cfg.workloads:
                sessions = build_workload(cfg, workload, tokenizer)
                before = read_counters(endpoints)
                t0 = time.monotonic()
                result: BenchResult = asyncio.run(
                    run_sessions(
                        endpoints["http"],
                        sessions,
                        concurrency=cfg.concurrency,
                        timeout_s=cfg.timeout_s,
                        progress=cfg.progress,
                        config={"workload": workload, "policy": policy},
                        # long-document: users come back after everyone else's turn
                        rounds=workload == "long-document",
                    )
                )
                after = read_counters(endpoints)
                workers = {w: growth(before[w], after[w]) for w in after if w in before}
                fig = figures(policy, workload, result, workers, layout)
                runs.append(WorkloadRun(policy, workload, result, workers, fig))
                say(
                    f"{policy} / {workload}: {fig.requests - fig.failed}/{fig.requests} ok in "
                    f"{time.monotonic() - t0:.0f} s, TTFT p50 {fig.ttft_p50_ms or 0:.0f} ms, "
                    f"{fig.computed_tokens}/{fig.prompt_tokens} prompt tokens computed"
                )
    return PrefixReport(
        date=date,
        command=command,
        machine=machine_info(),
        config={**asdict(cfg), "log_dir": str(log_root)},
        layout=layout,
        wall_s=time.monotonic() - started,
        runs=runs,
    )

"""The interference experiment: does disaggregation keep decode ITL flat under long prompts?

One command runs the same mixed workload (``bench.serve.workload.build_interference``:
steady decode streams plus long prompts arriving on a schedule) against, in turn:

  colocated           one colocated worker, both cores (``pdserve up --colocated``)
  colocated-chunked   the same with chunked prefill (``--chunked-prefill``)
  disaggregated       one prefill worker pinned to one core, one decode worker pinned to
                      the other (``pdserve up --prefill 1 --decode 1 --pin``); redis, the
                      scheduler, the gateway and this load generator on the prefill
                      worker's core, so the decode core runs the decode worker alone; the
                      KV store on, as by default
  disaggregated-no-store  the same without the KV store (``--kv-store-segment-mib 0``):
                      what the store costs the decode tail
  llama.cpp           optional (``--peer``): llama.cpp's ``llama-server`` on both cores with
                      parallel slots, on the same GGUF (benchmark-only; built by
                      ``python -m bench.peers.llama_server build``)

Every pdserve mode runs behind the same gateway and scheduler, so the only difference is
where prefill runs. Each stack gets an untimed warm-up (one stream and one long prompt)
before the measured run. ITL figures are over the steady streams' inter-token gaps
(tag ``stream``); TTFT figures over every request, and over the long prompts alone.

It prints one side-by-side table, the steady streams' ITL split by what the server was doing
(a long prompt prefilling, a long request decoding in the batch, neither), checks the
issue's targets, writes the JSON of every run and the plots (ITL over time per mode with
the long-prompt arrivals marked; latency CDFs). ``--report RUN.json`` prints all of that
again from a saved run without measuring.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._common import machine_info, pinned

NO_STORE = "disaggregated-no-store"
MODES = ("colocated", "colocated-chunked", "disaggregated", NO_STORE)
# On request only: the disaggregated stack with `pdserve up --no-pin` (the OS places every
# process and thread), the reference for what pinning buys.
UNPINNED = "disaggregated-unpinned"
PEER = "llama.cpp"


@dataclass(frozen=True)
class Mode:
    """One way to serve the workload: a name and the ``pdserve up`` flags (or the peer)."""

    name: str
    up_flags: tuple[str, ...] = ()
    peer: bool = False
    describe: str = ""
    client_cpus: frozenset[int] | None = None  # pin this load generator while it measures


def modes_for(args: argparse.Namespace) -> list[Mode]:
    threads = str(args.threads)
    n_threads = f"{threads} thread{'' if args.threads == 1 else 's'}"
    common = ("--kv-cache-mib", str(args.kv_cache_mib), "--max-num-seqs", "64",
              "--kv-cache-dtype", args.kv_cache_dtype)  # fmt: skip
    # a colocated worker's threads float over the machine's cores (--no-pin)
    colocated = ("--colocated", "--no-pin", "--threads", threads, *common)
    chunked = ("--chunked-prefill", str(args.chunk))
    first_core = str(min(os.sched_getaffinity(0)))
    disaggregated = ("--prefill", "1", "--decode", "1", "--pin", "--threads", "1")
    # redis, scheduler and gateway share the prefill worker's core: the decode core is the
    # decode worker's alone (a colocated worker has no core to spare, so there they float).
    disaggregated += ("--control-cpus", first_core)
    unpinned = ("--prefill", "1", "--decode", "1", "--no-pin", "--threads", "1")
    transport = ("--transport", args.transport)
    table = {
        "colocated": Mode(
            "colocated",
            colocated,
            describe=f"one colocated worker, {n_threads}, no chunking",
        ),
        "colocated-chunked": Mode(
            "colocated-chunked",
            (*colocated, *chunked),
            describe=f"one colocated worker, {n_threads}, chunks of {args.chunk} tokens",
        ),
        "disaggregated": Mode(
            "disaggregated",
            (*disaggregated, *transport, *common),
            describe=f"1 prefill + 1 decode, a core and 1 thread each, {args.transport}; "
            "control plane and this client on the prefill core",
            client_cpus=frozenset({int(first_core)}),
        ),
        NO_STORE: Mode(
            NO_STORE,
            (*disaggregated, *transport, *common, "--kv-store-segment-mib", "0"),
            describe=f"the same as disaggregated without the KV store, {args.transport}",
            client_cpus=frozenset({int(first_core)}),
        ),
        UNPINNED: Mode(
            UNPINNED,
            (*unpinned, *transport, *common),
            describe=f"1 prefill + 1 decode, 1 thread each, {args.transport}, nothing pinned",
        ),
        PEER: Mode(
            PEER,
            peer=True,
            describe=f"llama-server, {n_threads}, {args.streams + 1} parallel slots",
        ),
    }
    names = list(args.modes) + ([PEER] if args.peer and PEER not in args.modes else [])
    return [table[n] for n in names]


@dataclass
class ModeRun:
    mode: Mode
    result: Any  # bench.serve.runner.BenchResult
    summaries: dict[str, Any] = field(default_factory=dict)  # tag -> Summary dict
    error: str | None = None


# ---- starting what serves ------------------------------------------------------------------


@contextmanager
def pdserve_stack(mode: Mode, log_dir: Path) -> Iterator[str]:
    """``pdserve up`` with the mode's flags (same code path); yields the OpenAI base URL."""
    from services.launcher import Stack, free_port
    from services.up import launch, load_up_config

    up = load_up_config(
        [*mode.up_flags, "--http-port", str(free_port()), "--grpc-port", str(free_port())]
    )
    stack = Stack(log_dir=log_dir)
    try:
        endpoints = launch(up, stack)
        yield endpoints["http"].removesuffix("/v1")
    finally:
        stack.stop()


@contextmanager
def peer_server(args: argparse.Namespace, log_dir: Path) -> Iterator[str]:
    from bench.peers import llama_server
    from engine.checkpoint import default_model_path
    from services.launcher import free_port

    port = free_port()
    handle = llama_server.start(
        args.model or default_model_path(),
        port=port,
        host="127.0.0.1",
        parallel=args.streams + 1,
        ctx_size=llama_server.ctx_size_for(
            args.streams + 1,
            prompt_tokens=max(args.long_prompt_tokens, args.stream_prompt_tokens),
            output_tokens=max(args.stream_output_tokens, args.long_output_tokens),
        ),
        threads=args.threads,
        cpus=None,
        log_path=log_dir / "llama-server.log",
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        handle.stop()


# ---- one run ------------------------------------------------------------------------------


def run_mode(mode: Mode, args: argparse.Namespace, tokenizer: Any, log_dir: Path) -> ModeRun:
    from bench.serve.runner import run_benchmark
    from bench.serve.workload import build_interference

    requests = build_interference(
        tokenizer,
        streams=args.streams,
        stream_prompt_tokens=args.stream_prompt_tokens,
        stream_output_tokens=args.stream_output_tokens,
        long_prompt_tokens=args.long_prompt_tokens,
        long_output_tokens=args.long_output_tokens,
        long_start_s=args.long_start_s,
        long_every_s=args.long_every_s,
        long_count=args.long_count,
        seed=args.seed,
    )
    warmup = build_interference(
        tokenizer,
        streams=1,
        stream_prompt_tokens=args.stream_prompt_tokens,
        stream_output_tokens=8,
        long_prompt_tokens=args.long_prompt_tokens,
        long_output_tokens=2,
        long_start_s=0.0,
        long_every_s=1.0,
        long_count=1,
        seed=args.seed + 1,
    )
    server = peer_server(args, log_dir) if mode.peer else pdserve_stack(mode, log_dir)
    with server as base_url, pinned(mode.client_cpus):
        asyncio.run(run_benchmark(base_url, warmup, timeout_s=args.timeout_s, progress=False))
        _wait_quiet(args.max_load, args.quiet_timeout_s)
        result = asyncio.run(
            run_benchmark(base_url, requests, timeout_s=args.timeout_s, progress=args.progress)
        )
    return ModeRun(mode, result)


def _wait_quiet(max_load: float, timeout_s: float) -> None:
    """Wait (bounded) until the 1-minute load average drops under ``max_load``."""
    if max_load <= 0:
        return
    deadline = time.monotonic() + timeout_s
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        time.sleep(2.0)


# ---- the table ----------------------------------------------------------------------------


def summarize_runs(runs: Sequence[ModeRun], slo: Any) -> None:
    from bench.serve.metrics import summarize

    for run in runs:
        for tag in (None, "stream", "long"):
            run.summaries[tag or "all"] = summarize(run.result, slo, tag=tag).to_dict()


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f}"


def _stat(summary: dict[str, Any], metric: str, stat: str) -> float | None:
    return summary.get(metric, {}).get(stat)


def table_rows(runs: Sequence[ModeRun]) -> list[dict[str, Any]]:
    """One row of figures per mode (milliseconds and ratios, not yet formatted)."""
    rows = []
    for run in runs:
        every, streams, longs = run.summaries["all"], run.summaries["stream"], run.summaries["long"]
        itl50, itl99 = _stat(streams, "itl_ms", "p50"), _stat(streams, "itl_ms", "p99")
        rows.append({
            "mode": run.mode.name,
            "ttft_p50": _stat(every, "ttft_ms", "p50"),
            "ttft_p99": _stat(every, "ttft_ms", "p99"),
            "long_ttft_p50": _stat(longs, "ttft_ms", "p50"),
            "itl_p50": itl50,
            "itl_p99": itl99,
            "itl_ratio": (itl99 / itl50) if itl50 and itl99 else None,
            "itl_max": _stat(streams, "itl_ms", "max"),
            "req_per_s": every.get("request_throughput"),
            "tok_per_s": every.get("output_throughput"),
            "goodput": every.get("goodput"),
            "good_fraction": every.get("good_fraction"),
            "failed": every.get("num_failed", 0),
        })  # fmt: skip
    return rows


PHASES = ("prefill", "long-decode", "quiet")


def gap_phase(start: float, end: float, longs: Sequence[Any]) -> str:
    """What the server was doing during a stream's gap ``[start, end]`` (seconds).

    ``prefill``: the gap overlaps a long request's prefill window (its send to its first
    token); else ``long-decode``: it overlaps a long request's decode (first to last token);
    else ``quiet``. A long request without tokens counts as prefilling until it ended.
    """
    for r in longs:
        first = r.token_times_s[0] if r.token_times_s else r.end_s
        if start < first and end > r.send_s:
            return "prefill"
    for r in longs:
        if r.token_times_s and start < r.token_times_s[-1] and end > r.token_times_s[0]:
            return "long-decode"
    return "quiet"


def phase_rows(runs: Sequence[ModeRun]) -> list[dict[str, Any]]:
    """Per mode and phase (``PHASES``): the steady streams' ITL while a long prompt
    prefills, while one decodes in the batch, and neither (milliseconds)."""
    from bench.serve.metrics import stats

    rows = []
    for run in runs:
        records = [r for r in run.result.records if r.ok]
        longs = [r for r in records if r.tag == "long"]
        gaps: dict[str, list[float]] = {p: [] for p in PHASES}
        for r in (r for r in records if r.tag == "stream"):
            for a, b in zip(r.token_times_s, r.token_times_s[1:], strict=False):
                gaps[gap_phase(a, b, longs)].append((b - a) * 1000.0)
        for phase in PHASES:
            st = stats(gaps[phase])
            rows.append({"mode": run.mode.name, "phase": phase, "count": st.count,
                         "p50": st.p50, "p99": st.p99, "max": st.max})  # fmt: skip
    return rows


def format_phase_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| mode | streams' gaps while | gaps | ITL P50 ms | ITL P99 ms | max ITL ms |",
             "|" + "---|" * 6]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['phase']} | {r['count']} | {_ms(r['p50'])} | {_ms(r['p99'])} "
            f"| {_ms(r['max'])} |"
        )
    return "\n".join(lines)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        "| mode | TTFT P50 ms | TTFT P99 ms | long TTFT P50 ms | ITL P50 ms | ITL P99 ms "
        "| P99/P50 ITL | max ITL ms | req/s | out tok/s | goodput req/s (good) | failed |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        ratio = "—" if r["itl_ratio"] is None else f"{r['itl_ratio']:.2f}"
        good = "—" if r["goodput"] is None else f"{r['goodput']:.3f} ({r['good_fraction']:.0%})"
        lines.append(
            f"| {r['mode']} | {_ms(r['ttft_p50'])} | {_ms(r['ttft_p99'])} "
            f"| {_ms(r['long_ttft_p50'])} | {_ms(r['itl_p50'])} | {_ms(r['itl_p99'])} "
            f"| {ratio} | {_ms(r['itl_max'])} | {r['req_per_s']:.3f} | {r['tok_per_s']:.1f} "
            f"| {good} | {r['failed']} |"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Check:
    name: str
    measured: str
    target: str
    passed: bool


def check_targets(rows: Sequence[dict[str, Any]]) -> list[Check]:
    """The issue's targets, from one run's rows (only those whose modes ran)."""
    by = {r["mode"]: r for r in rows}
    out: list[Check] = []
    dis, col = by.get("disaggregated"), by.get("colocated")
    if dis and dis["itl_ratio"] is not None:
        out.append(Check("disaggregated P99/P50 ITL", f"{dis['itl_ratio']:.2f}", "≤ 1.3",
                         dis["itl_ratio"] <= 1.3))  # fmt: skip
    bare = by.get(NO_STORE)
    if dis and bare and dis["itl_p99"] and bare["itl_p99"]:
        r = dis["itl_p99"] / bare["itl_p99"]
        out.append(Check("disaggregated P99 ITL ÷ the same without the KV store", f"{r:.2f}",
                         "≤ 1.15", r <= 1.15))  # fmt: skip
    if dis and dis["itl_max"] and dis["itl_p50"]:
        r = dis["itl_max"] / dis["itl_p50"]
        out.append(Check("disaggregated max ITL ÷ its P50", f"{r:.2f}", "≤ 2.5", r <= 2.5))
    if col and col["itl_ratio"] is not None:
        out.append(Check("colocated P99/P50 ITL", f"{col['itl_ratio']:.2f}", "≥ 5",
                         col["itl_ratio"] >= 5.0))  # fmt: skip
    if dis and col and dis["itl_p99"] and col["itl_p99"]:
        r = dis["itl_p99"] / col["itl_p99"]
        out.append(Check("disaggregated P99 ITL ÷ colocated P99 ITL", f"{r:.2f}", "≤ 0.33",
                         r <= 1 / 3))  # fmt: skip
    if dis and col and dis["ttft_p99"] and col["ttft_p99"]:
        r = dis["ttft_p99"] / col["ttft_p99"]
        out.append(Check("disaggregated P99 TTFT ÷ colocated P99 TTFT", f"{r:.2f}", "≤ 1.0",
                         r <= 1.0))  # fmt: skip
    peer = by.get(PEER)
    if dis and peer and dis["itl_p50"] and peer["itl_p50"]:
        r = dis["itl_p50"] / peer["itl_p50"]
        out.append(Check("disaggregated ITL P50 ÷ llama.cpp ITL P50", f"{r:.2f}", "≤ 1.0",
                         r <= 1.0))  # fmt: skip
    return out


def late_long_prompts(run: ModeRun) -> tuple[int, int]:
    """How many of the run's long prompts were sent after every stream had ended (they
    interfered with nothing), and how many it sent. A nonzero first count means the streams
    outran the schedule (a host faster than the one the defaults were set on), so the ITL
    figures hold fewer long prompts than asked."""
    records = [r for r in run.result.records if r.ok]
    last_stream = max((r.end_s for r in records if r.tag == "stream"), default=0.0)
    longs = [r for r in records if r.tag == "long"]
    return sum(1 for r in longs if r.send_s >= last_stream), len(longs)


def format_late_notes(runs: Sequence[ModeRun]) -> str:
    """A note per mode whose streams ended before some long prompts were sent."""
    notes = []
    for run in runs:
        late, longs = late_long_prompts(run)
        if late:
            notes.append(
                f"  NOTE  {run.mode.name}: {late} of {longs} long prompts came after every "
                "stream had ended and interfered with nothing; lower --long-every-s or raise "
                "--stream-output-tokens so they fall inside the streams"
            )
    return "\n".join(notes)


def format_checks(checks: Sequence[Check]) -> str:
    return "\n".join(
        f"  {'PASS' if c.passed else 'MISS'}  {c.name}: {c.measured} (target {c.target})"
        for c in checks
    )


# ---- command line -------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.interference",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--modes", nargs="+", choices=(*MODES, UNPINNED), default=list(MODES),
                   help=f"what to run (default: all but {UNPINNED})")  # fmt: skip
    p.add_argument("--peer", action="store_true", help="also run llama.cpp's llama-server")
    p.add_argument("--streams", type=int, default=8, help="steady decode streams")
    p.add_argument("--stream-prompt-tokens", type=int, default=32)
    p.add_argument("--stream-output-tokens", type=int, default=256)
    p.add_argument("--long-prompt-tokens", type=int, default=1024)
    p.add_argument("--long-output-tokens", type=int, default=16)
    p.add_argument("--long-start-s", type=float, default=3.0, help="first long prompt at")
    p.add_argument("--long-every-s", type=float, default=6.0, help="then one every")
    p.add_argument("--long-count", type=int, default=5, help="long prompts in all")
    p.add_argument("--threads", type=int, default=2, help="threads of a colocated worker")
    p.add_argument("--chunk", type=int, default=128, help="colocated-chunked: chunk tokens")
    p.add_argument("--transport", default="shm", choices=("shm", "tcp"))
    p.add_argument("--kv-cache-mib", type=int, default=256)
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "float32", "float16"),
        help="pdserve workers' KV dtype (auto: theirs, float16 on the CPU, as llama-server's)",
    )
    p.add_argument("--model", default=None, help="GGUF (default: SmolLM2-135M-Instruct)")
    p.add_argument("--slo-ttft-ms", type=float, default=4000.0)
    p.add_argument("--slo-itl-ms", type=float, default=200.0)
    p.add_argument("--timeout-s", type=float, default=300.0, help="deadline per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-load", type=float, default=1.0,
                   help="before each measured run wait until the 1-min load is below this "
                   "(0: don't wait)")  # fmt: skip
    p.add_argument("--quiet-timeout-s", type=float, default=120.0)
    p.add_argument("--json", type=Path, default=None, help="write every run's records here")
    p.add_argument("--plot-dir", type=Path, default=None, help="write the PNG plots here")
    p.add_argument("--log-dir", type=Path, default=None, help="service logs (default: tmp)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--report", type=Path, default=None, metavar="JSON",
                   help="measure nothing: print the tables and checks of a saved --json run "
                   "(and redraw its plots with --plot-dir)")  # fmt: skip
    return p


def load_runs(path: Path) -> tuple[list[ModeRun], dict[str, Any]]:
    """The runs of a JSON this tool wrote (``--json``), and the run's config."""
    from bench.serve.result import BenchResult

    doc = json.loads(path.read_text())
    runs = [
        ModeRun(Mode(name, describe=m.get("describe", "")), BenchResult.from_dict(m["result"]))
        for name, m in doc["modes"].items()
    ]
    return runs, doc.get("config", {})


def report(
    runs: list[ModeRun], slo: Any, out: Callable[[str], None], plot_dir: Path | None
) -> tuple[list[dict[str, Any]], list[Check]]:
    """Summarize, print the side-by-side table, the ITL by phase and the checks; plot."""
    from bench.serve.plots import plot_cdfs, plot_itl_over_time

    summarize_runs(runs, slo)
    rows = table_rows(runs)
    checks = check_targets(rows)
    out("")
    out(format_table(rows))
    out("")
    out(format_phase_table(phase_rows(runs)))
    out("")
    out(format_checks(checks))
    notes = format_late_notes(runs)
    if notes:
        out(notes)
    if plot_dir:
        plot_dir.mkdir(parents=True, exist_ok=True)
        results = {r.mode.name: r.result for r in runs}
        plot_itl_over_time(results, plot_dir / "interference-itl.png")
        plot_cdfs(results, plot_dir / "interference-cdf.png")
        out(f"plots: {plot_dir}/interference-itl.png, interference-cdf.png")
    return rows, checks


def main(argv: Sequence[str] | None = None, *, out: Callable[[str], None] = print) -> int:
    args = build_parser().parse_args(argv)
    from bench.serve.metrics import Slo
    from bench.serve.workload import default_tokenizer
    from services.launcher import default_log_dir

    if args.report is not None:
        runs, config = load_runs(args.report)
        slo = Slo(ttft_ms=config.get("slo_ttft_ms", args.slo_ttft_ms),
                  itl_ms=config.get("slo_itl_ms", args.slo_itl_ms))  # fmt: skip
        out(f"report of {args.report} (SLO TTFT {slo.ttft_ms:g} ms, ITL {slo.itl_ms:g} ms)")
        report(runs, slo, out, args.plot_dir)
        return 0
    if args.peer:
        from bench.peers import llama_server

        binary = llama_server.BuildLayout(llama_server.default_cache_dir()).binary
        if not binary.exists():
            out("llama-server is not built: python -m bench.peers.llama_server build")
            return 2
    tokenizer = default_tokenizer()
    log_root = args.log_dir or default_log_dir()
    slo = Slo(ttft_ms=args.slo_ttft_ms, itl_ms=args.slo_itl_ms)
    started = time.time()
    runs: list[ModeRun] = []
    for mode in modes_for(args):
        out(f"== {mode.name}: {mode.describe}")
        log_dir = log_root / mode.name
        log_dir.mkdir(parents=True, exist_ok=True)
        runs.append(run_mode(mode, args, tokenizer, log_dir))
    rows, checks = report(runs, slo, out, args.plot_dir)
    if args.json:
        doc = {
            "command": " ".join(["python -m bench.interference", *(argv or sys.argv[1:])]),
            "machine": machine_info(),
            "started": started,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "modes": {
                r.mode.name: {
                    "describe": r.mode.describe,
                    "summaries": r.summaries,
                    "result": r.result.to_dict(),
                }
                for r in runs
            },
            "rows": rows,
            "checks": [c.__dict__ for c in checks],
        }
        args.json.write_text(json.dumps(doc, indent=1))
        out(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

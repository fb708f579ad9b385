"""``pdserve bench``: load-test any OpenAI-compatible server (pdserve's gateway,
llama.cpp's llama-server) with streaming requests and report TTFT, ITL, TPOT, E2E,
throughput and goodput.

Workloads: ``fixed`` (one prompt/output length), ``dist`` (lengths drawn uniform or
lognormal), ``interference`` (decode streams plus long prompts on a schedule). Prompts have
exact token lengths (default model's tokenizer, or --tokenizer) and open with a fresh
random nonce, so no server's prefix cache hits. Arrivals (fixed, dist): poisson, rate or
concurrency; interference follows its own schedule.

Prefix reuse (chat): ``multi-turn`` (--sessions conversations of --turns turns over one
shared system prompt; each turn sends the whole conversation so far, the model's earlier
answers included, once the previous turn is answered), ``shared-prefix`` (--users
one-turn requests over --system-prompts system prompts) and ``long-document`` (--sessions
conversations of --turns questions, each over a document of its own of --document-tokens
words: a working set of whole documents, for a KV store below the pools). --concurrency
sessions run at once. Each system prompt opens with a fresh nonce (no two runs share a
cached block) and so does each session's first user message (sessions share the system
prompt, nothing else). Reported besides latency: prompt tokens cached vs computed (the server's
usage.prompt_tokens_details.cached_tokens), KV bytes moved per request and the same per
worker (pdserve's "pdserve" response object; docs/api.md).

Overload (``overload``): --streams clients in a closed loop while quiet, then the same plus
--flood more, --stalled clients that never read and --huge prompts of --huge-mib MiB, then
once more; prints a PASS/FAIL verdict: nothing hangs, the excess is refused (429/503) within
a second, the huge prompts get a 4xx within a second, the admitted streams' ITL P99 stays
within 3x the quiet P50, and the server serves normally afterwards (``bench.serve.overload``).

Trace replay (``trace``): --trace FILE, a Mooncake-format JSONL trace (timestamp ms,
input_length, output_length, hash_ids of 512-token prefix blocks; ``python -m
bench.serve.trace_gen`` writes one), replayed open loop: each request at its timestamp,
whatever the earlier ones did. Equal hash ids give byte-identical prompt blocks (seeded by a
per-run nonce), so requests share exactly the prefixes the trace says. Fitted to the host by
--trace-token-divisor (lengths and blocks / D), --trace-time-scale (gaps x S),
--trace-sample (N whole conversations: requests sharing a first hash id) and the caps.
Reported besides latency: good_fraction under the SLOs (default here: TTFT 2000 ms, ITL
200 ms), the largest inter-token gap, and the cached share of prompt tokens as the server
reports it, beside the most a prefix cache could have skipped.

Goodput: a request is good when it succeeded, its TTFT <= --slo-ttft-ms and every one of its
inter-token gaps <= --slo-itl-ms (an SLO not given is not checked, but for the trace
workload's defaults). Failed requests are never good; goodput is good requests per second
of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from bench.serve.arrival import Arrival, Concurrency, FixedRate, Poisson, Schedule

if TYPE_CHECKING:
    from bench.serve.client import Endpoint
    from bench.serve.metrics import Slo
    from bench.serve.result import BenchResult
    from bench.serve.sessions import Session
    from bench.serve.workload import RequestSpec
    from engine.tokenizer import Tokenizer

SESSION_WORKLOADS = ("multi-turn", "shared-prefix", "long-document")
WORKLOADS = ("fixed", "dist", "interference", *SESSION_WORKLOADS, "trace", "overload")
# The trace workload's SLOs when none is given (docs/benchmarks.md, "Trace replay", says why).
TRACE_SLO_TTFT_MS = 2000.0
TRACE_SLO_ITL_MS = 200.0
ARRIVALS = ("poisson", "rate", "concurrency")
T = TypeVar("T")


def _span(text: str) -> tuple[int, int]:
    """``"2000,4000"`` -> ``(2000, 4000)``: a positive MIN,MAX with MIN <= MAX."""
    try:
        low, high = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX, got {text!r}") from None
    if not 0 < low <= high:
        raise argparse.ArgumentTypeError(f"expected 0 < MIN <= MAX, got {text!r}")
    return low, high


_Flag = tuple[str, dict[str, Any]]


def _flag(name: str, default: Any = None, help: str | None = None, **kw: Any) -> _Flag:
    """One row of the flag table; a number's default gives the flag its type."""
    if isinstance(default, int | float) and not isinstance(default, bool):
        kw.setdefault("type", type(default))
    return name, {"default": default, "help": help, **kw}


_D = "(default: %(default)s)"
# The flags of ``pdserve bench``, in the groups and the order --help shows them.
FLAG_GROUPS: tuple[tuple[str, tuple[_Flag, ...]], ...] = (
    ("server", (
        _flag("--base-url", "http://127.0.0.1:8000", f"server root or its /v1 URL {_D}"),
        _flag("--model", None, "model name sent in requests (default: the first of /v1/models)"),
        _flag("--endpoint", None, "/v1/completions or /v1/chat/completions (default: chat for "
              "multi-turn and shared-prefix, which need it, else completions)",
              choices=("completions", "chat")),
        _flag("--prompt-format", "ids", "completions: send prompts as token-id lists or as text "
              f"{_D}", choices=("ids", "text")),
        _flag("--ignore-eos", None, "ask the server to ignore EOS so outputs have the asked "
              "length (vLLM/llama-server extension; default: on, but off for multi-turn and "
              "shared-prefix, whose answers go back into the conversation as the model ended "
              "them)", action=argparse.BooleanOptionalAction),
        _flag("--tokenizer", None, "GGUF file or HF tokenizer directory to build prompts with "
              "(default: pdserve's default model)", type=Path),
        _flag("--timeout-s", 300.0, "deadline of each request; past it the request is recorded "
              f"as failed {_D}"),
    )),
    ("workload", (
        _flag("--workload", "fixed", "default: %(default)s", choices=WORKLOADS),
        _flag("--num-requests", 32, "fixed, dist (default: 32)"),
        _flag("--seed", 0, "seeds lengths, filler words, Poisson gaps and --trace-sample "
              "(nonces stay fresh)"),
        _flag("--prompt-tokens", 256, "fixed: prompt length; dist lognormal: median "
              "(default: 256)"),
        _flag("--output-tokens", 128, "fixed: output length; dist lognormal: median; "
              "conversations: each turn's max_tokens (default: 128)"),
        _flag("--dist", "uniform", f"dist: length distribution {_D}",
              choices=("uniform", "lognormal")),
        _flag("--prompt-range", (64, 1024), "dist: prompt lengths in [LO, HI] (default: 64 1024)",
              type=int, nargs=2, metavar=("LO", "HI")),
        _flag("--output-range", (16, 256), "dist: output lengths in [LO, HI] (default: 16 256)",
              type=int, nargs=2, metavar=("LO", "HI")),
        _flag("--sigma", 0.5, "dist lognormal: sigma of ln(length)"),
        _flag("--streams", 8, "interference: decode streams"),
        _flag("--stream-prompt-tokens", 32),
        _flag("--stream-output-tokens", 256),
        _flag("--stream-stagger-s", 0.01, "interference: stream i starts at i * this"),
        _flag("--long-prompt-tokens", 1024),
        _flag("--long-output-tokens", 16),
        _flag("--long-start-s", 2.0, f"interference: first long prompt {_D}"),
        _flag("--long-every-s", 4.0, f"interference: then one every this {_D}"),
        _flag("--long-count", None, "interference: this many long prompts (default: until the "
              "streams finish)", type=int),
    )),
    ("overload (--streams clients; --prompt-tokens, --output-tokens)", (
        _flag("--flood", 48, f"more clients {_D}"),
        _flag("--stalled", 8, f"clients that never read {_D}"),
        _flag("--huge", 3, f"huge prompts {_D}"),
        _flag("--huge-mib", 3.0, "their size (default: 3 MiB)"),
        _flag("--quiet-s", 20.0, "quiet phase (default: 20 s)"),
        _flag("--overload-s", 30.0, "overload phase (default: 30 s)"),
        _flag("--retry-s", 1.0, "a refused client waits this long before it tries again "
              "(default: 1 s, what pdserve's Retry-After asks)"),
    )),
    ("conversations (multi-turn, shared-prefix; --output-tokens each)", (
        _flag("--sessions", 8, f"multi-turn {_D}"),
        _flag("--turns", 4, f"multi-turn: turns a session {_D}"),
        _flag("--system-prompts", 4, f"shared-prefix {_D}"),
        _flag("--users", 32, f"shared-prefix: requests {_D}"),
        _flag("--system-tokens", 512, f"words (one token each) of a system prompt {_D}"),
        _flag("--rounds", False, "send every session's turn k before any session's turn k+1 "
              "(users who come back after a while: a conversation's KV has left small pools by "
              "its next turn)", action="store_true"),
        _flag("--document-tokens", (2000, 4000), "long-document: words of each session's "
              "document, drawn in [MIN, MAX] (default: 2000,4000)", type=_span,
              metavar="MIN,MAX"),
        _flag("--user-tokens", 64, f"words of a user message {_D}"),
    )),
    ("trace (Mooncake JSONL; python -m bench.serve.trace_gen writes one)", (
        _flag("--trace", None, "the trace to replay (--workload trace)", type=Path,
              metavar="FILE"),
        _flag("--trace-token-divisor", 16, "divide input and output lengths and the 512-token "
              "blocks by D, a divisor of 512; an output keeps at least 1 token (default: 16: "
              "Mooncake's thousands of tokens become hundreds, blocks of 32)", metavar="D"),
        _flag("--trace-time-scale", 1.0, "multiply the gaps between timestamps by S (above 1: "
              f"slower than recorded) {_D}", metavar="S"),
        _flag("--trace-sample", None, "keep N conversations (requests sharing their first hash "
              "id) drawn with --seed, every request of each (default: all)", type=int,
              metavar="N"),
        _flag("--trace-max-requests", 1000, f"send at most the first N {_D}", metavar="N"),
        _flag("--trace-duration-s", 600.0, "send only what is scheduled in the first S seconds "
              f"{_D}", metavar="S"),
    )),
    ("arrival (fixed, dist; conversations: --concurrency)", (
        _flag("--arrival", None, "poisson at --rate (default), fixed --rate, or closed loop at "
              "--concurrency", choices=ARRIVALS),
        _flag("--rate", 1.0, "requests/s (default: 1)"),
        _flag("--concurrency", 4, "in flight, or sessions at once (default: 4)"),
    )),
    ("SLOs and output", (
        _flag("--slo-ttft-ms", None, "goodput: a good request's TTFT is at most this (default: "
              f"none; trace: {TRACE_SLO_TTFT_MS:g})", type=float),
        _flag("--slo-itl-ms", None, "goodput: every inter-token gap of a good request is at "
              f"most this (default: none; trace: {TRACE_SLO_ITL_MS:g})", type=float),
        _flag("--json", None, "write config, every request's record (all token times) and the "
              "summaries", type=Path, metavar="PATH"),
        _flag("--plot-dir", None, "write itl_over_time.png and latency_cdf.png here", type=Path,
              metavar="DIR"),
        _flag("--label", "run", "this run's name in the plots"),
        _flag("--no-progress", False, "no progress bar", action="store_true"),
    )),
)  # fmt: skip


def add_bench_flags(p: argparse.ArgumentParser) -> None:
    """The ``pdserve bench`` / ``python -m bench.serve`` flags (``FLAG_GROUPS``)."""
    for title, flags in FLAG_GROUPS:
        group = p.add_argument_group(title)
        for name, kw in flags:
            group.add_argument(name, **kw)


def endpoint_from_args(args: argparse.Namespace) -> Endpoint:
    """The endpoint to send to; ``ValueError`` when the workload cannot use the one asked."""
    if args.workload in SESSION_WORKLOADS:
        if args.endpoint == "completions":
            raise ValueError(f"{args.workload} sends chat messages: drop --endpoint completions")
        return "chat"
    if args.workload == "trace" and args.endpoint == "chat":
        raise ValueError("trace sends token-id prompts of exact lengths: drop --endpoint chat")
    return args.endpoint or "completions"


def ignore_eos_from_args(args: argparse.Namespace) -> bool:
    if args.ignore_eos is not None:
        return bool(args.ignore_eos)
    return args.workload not in SESSION_WORKLOADS


def arrival_from_args(args: argparse.Namespace) -> Arrival:
    """The arrival pattern the flags ask for; ``ValueError`` when they do not fit."""
    if args.workload in ("interference", "trace"):
        if args.arrival is not None:
            raise ValueError(f"the {args.workload} workload has its own schedule: drop --arrival")
        return Schedule()
    if args.workload in SESSION_WORKLOADS:
        if args.arrival not in (None, "concurrency"):
            raise ValueError(f"{args.workload} runs --concurrency sessions at once: drop --arrival")
        return Concurrency(args.concurrency)
    kind = args.arrival or "poisson"
    if kind == "poisson":
        return Poisson(args.rate, args.seed)
    if kind == "rate":
        return FixedRate(args.rate)
    return Concurrency(args.concurrency)


def workload_from_args(args: argparse.Namespace) -> tuple[list[RequestSpec], dict[str, Any]]:
    """The requests the flags describe, and the workload's config for the JSON."""
    from bench.serve import workload as wl

    tokenizer = wl.default_tokenizer(args.tokenizer)
    if args.workload == "trace":
        return _trace_workload(args, tokenizer)
    chat = endpoint_from_args(args) == "chat"
    common = {"seed": args.seed, "chat": chat}
    params: dict[str, Any]
    if args.workload == "fixed":
        params = {
            "num_requests": args.num_requests,
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
        }
        specs = wl.build_fixed(tokenizer, **params, **common)
    elif args.workload == "dist":
        (plo, phi), (olo, ohi) = args.prompt_range, args.output_range
        prompt_dist: wl.LengthDist
        output_dist: wl.LengthDist
        if args.dist == "uniform":
            prompt_dist, output_dist = wl.Uniform(plo, phi), wl.Uniform(olo, ohi)
        else:
            prompt_dist = wl.LogNormal(args.prompt_tokens, args.sigma, plo, phi)
            output_dist = wl.LogNormal(args.output_tokens, args.sigma, olo, ohi)
        specs = wl.build_dist(
            tokenizer,
            num_requests=args.num_requests,
            prompt_dist=prompt_dist,
            output_dist=output_dist,
            **common,
        )
        params = {
            "num_requests": args.num_requests,
            "prompt_dist": vars(prompt_dist),
            "output_dist": vars(output_dist),
            "dist": args.dist,
        }
    else:
        params = {
            "streams": args.streams,
            "stream_prompt_tokens": args.stream_prompt_tokens,
            "stream_output_tokens": args.stream_output_tokens,
            "stream_stagger_s": args.stream_stagger_s,
            "long_prompt_tokens": args.long_prompt_tokens,
            "long_output_tokens": args.long_output_tokens,
            "long_start_s": args.long_start_s,
            "long_every_s": args.long_every_s,
            "long_count": args.long_count,
        }
        specs = wl.build_interference(tokenizer, **params, **common)
    return specs, _config(args, params)


def _trace_workload(
    args: argparse.Namespace, tokenizer: Tokenizer
) -> tuple[list[RequestSpec], dict[str, Any]]:
    """The requests of ``--trace``, fitted by the ``--trace-*`` flags, and their config (the
    replay's stats under ``trace_stats``)."""
    from bench.serve.report import trace_plan_line
    from bench.serve.trace import read_trace
    from bench.serve.trace_replay import ReplayOptions, build_trace

    opts = ReplayOptions(
        token_divisor=args.trace_token_divisor,
        time_scale=args.trace_time_scale,
        sample=args.trace_sample,
        seed=args.seed,
        max_requests=args.trace_max_requests,
        duration_s=args.trace_duration_s,
    )
    specs, stats = build_trace(tokenizer, read_trace(args.trace), opts)
    print(f"replaying {trace_plan_line(stats.to_dict())}", file=sys.stderr)
    params = {"trace": str(args.trace), **vars(opts), "trace_stats": stats.to_dict()}
    return specs, _config(args, params)


def sessions_from_args(args: argparse.Namespace) -> tuple[list[Session], dict[str, Any]]:
    """The conversations of ``multi-turn`` / ``shared-prefix``, and their config."""
    from bench.serve import sessions as ss
    from bench.serve.workload import default_tokenizer

    tokenizer = default_tokenizer(args.tokenizer)
    lengths = {
        "system_tokens": args.system_tokens,
        "user_tokens": args.user_tokens,
        "output_tokens": args.output_tokens,
    }
    params: dict[str, Any]
    if args.workload == "multi-turn":
        params = {"sessions": args.sessions, "turns": args.turns, **lengths}
        built = ss.build_multi_turn(tokenizer, **params, seed=args.seed)
    elif args.workload == "long-document":
        low, high = args.document_tokens
        params = {"sessions": args.sessions, "turns": args.turns, "min_doc_tokens": low,
                  "max_doc_tokens": high, "user_tokens": args.user_tokens,
                  "output_tokens": args.output_tokens}  # fmt: skip
        built = ss.build_long_document(tokenizer, **params, seed=args.seed)
    else:
        params = {"system_prompts": args.system_prompts, "users": args.users, **lengths}
        built = ss.build_shared_prefix(tokenizer, **params, seed=args.seed)
    return built, _config(args, params)


def _config(args: argparse.Namespace, params: dict[str, Any]) -> dict[str, Any]:
    return {
        "workload": args.workload,
        **params,
        "seed": args.seed,
        "tokenizer": str(args.tokenizer) if args.tokenizer else "default",
    }


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark the flags describe; print the summary table; write JSON and plots.

    Returns 0 when at least one request succeeded, 1 when none did, 2 for bad flags.
    """
    if args.workload == "overload":
        return _run_overload(args)
    slo = slo_from_args(args)
    result = _run_or_exit(args, lambda: _benchmark(args, slo))
    if isinstance(result, int):
        return result
    _report(args, result, slo)
    return 0 if any(r.ok for r in result.records) else 1


def _run_or_exit(args: argparse.Namespace, build: Callable[[], Coroutine[Any, Any, T]]) -> T | int:
    """Build the run (``ValueError``: bad flags) and run it; an exit code where that failed:
    2 for bad flags, 1 when the server could not be reached or failed the run."""
    import aiohttp

    try:
        return asyncio.run(build())
    except ValueError as exc:
        print(f"pdserve bench: {exc}", file=sys.stderr)
        return 2
    except (aiohttp.ClientError, OSError, RuntimeError, TimeoutError) as exc:
        print(f"pdserve bench: {args.base_url}: {exc or type(exc).__name__}", file=sys.stderr)
        return 1


def slo_from_args(args: argparse.Namespace) -> Slo | None:
    """The SLOs the flags ask for, the trace workload's where it is given none; ``None``
    when nothing is checked."""
    from bench.serve.metrics import Slo

    ttft, itl = args.slo_ttft_ms, args.slo_itl_ms
    if args.workload == "trace":
        ttft = TRACE_SLO_TTFT_MS if ttft is None else ttft
        itl = TRACE_SLO_ITL_MS if itl is None else itl
    if ttft is None and itl is None:
        return None
    return Slo(ttft_ms=ttft, itl_ms=itl)


def _benchmark(args: argparse.Namespace, slo: Slo | None) -> Coroutine[Any, Any, BenchResult]:
    """The run the flags describe: conversations or independent requests."""
    from bench.serve.runner import run_benchmark
    from bench.serve.session_runner import run_sessions

    if (args.workload == "trace") != (args.trace is not None):
        raise ValueError("--workload trace and --trace FILE go together")
    endpoint = endpoint_from_args(args)
    arrival = arrival_from_args(args)
    common = {
        "model": args.model,
        "timeout_s": args.timeout_s,
        "progress": not args.no_progress,
        "ignore_eos": ignore_eos_from_args(args),
    }
    if args.workload in SESSION_WORKLOADS:
        sessions, workload_config = sessions_from_args(args)
        config = {**workload_config, "slo": vars(slo) if slo else None}
        return run_sessions(
            args.base_url,
            sessions,
            concurrency=args.concurrency,
            config=config,
            rounds=args.rounds,
            **common,
        )
    specs, workload_config = workload_from_args(args)
    config = {**workload_config, "slo": vars(slo) if slo else None}
    return run_benchmark(
        args.base_url,
        specs,
        arrival=arrival,
        endpoint=endpoint,
        prompt_format=args.prompt_format,
        config=config,
        **common,
    )


def _report(args: argparse.Namespace, result: BenchResult, slo: Slo | None) -> None:
    """Print the summary (and prefix reuse, when the server reported it); write JSON, plots."""
    from bench._common import write_json
    from bench.serve.metrics import summarize_by_tag
    from bench.serve.report import summary_table, trace_report
    from bench.serve.reuse import reuse_table, summarize_reuse_by_tag, worker_table

    summaries = summarize_by_tag(result, slo)
    reuse = summarize_reuse_by_tag(result)
    cfg = result.config
    dropped = f", {cfg['dropped']} not sent" + (
        " (a turn before failed)"
        if args.workload in SESSION_WORKLOADS
        else " (scheduled after the streams finished)"
    )
    print(
        f"model {cfg['model']} at {args.base_url} ({endpoint_from_args(args)}), workload "
        f"{args.workload}: {len(result.records)} requests in {result.duration_s:.2f} s"
        + (dropped if cfg["dropped"] else "")
    )
    print(summary_table(summaries))
    if args.workload == "trace":
        print("\n" + trace_report(cfg["trace_stats"], summaries["all"], reuse["all"]))
    if reuse["all"].total.requests:  # the server reported cached tokens
        print("\nprefix reuse:")
        print(reuse_table(reuse))
        print("\nby the worker that computed the prompt:")
        print(worker_table(reuse["all"]))
    errors = sorted({r.error for r in result.records if r.error})
    for err in errors[:5]:
        print(f"failed: {err}")
    if args.json is not None:
        write_json(
            args.json,
            {
                **result.to_dict(),
                "summaries": {k: s.to_dict() for k, s in summaries.items()},
                "reuse": {k: s.to_dict() for k, s in reuse.items()},
            },
        )
        print(f"wrote {args.json}")
    if args.plot_dir is not None:
        from bench.serve.plots import plot_cdfs, plot_itl_over_time

        plot_itl_over_time({args.label: result}, args.plot_dir / "itl_over_time.png")
        plot_cdfs({args.label: result}, args.plot_dir / "latency_cdf.png")
        print(f"wrote plots to {args.plot_dir}")


def _run_overload(args: argparse.Namespace) -> int:
    """``--workload overload``: run it, print the figures and the verdict (exit 0 on PASS)."""
    from bench._common import write_json
    from bench.serve import overload
    from bench.serve import workload as wl

    cfg = overload.OverloadConfig(
        streams=args.streams, flood=args.flood, stalled=args.stalled, huge=args.huge,
        huge_mib=args.huge_mib, quiet_s=args.quiet_s, overload_s=args.overload_s,
        retry_s=args.retry_s, timeout_s=args.timeout_s,
    )  # fmt: skip

    def build() -> Coroutine[Any, Any, list[overload.Phase]]:
        specs = wl.build_fixed(
            wl.default_tokenizer(args.tokenizer),
            num_requests=max(args.streams, 1) * 4,
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            seed=args.seed,
        )
        return overload.run_overload(args.base_url, specs, cfg, args.model)

    phases = _run_or_exit(args, build)
    if isinstance(phases, int):
        return phases
    ok, lines = overload.verdict(phases)
    print(f"overload at {args.base_url}: {vars(cfg)}")
    print("\n".join(lines))
    if args.json is not None:
        write_json(args.json, {"config": vars(cfg), "lines": lines, "phases": {
            p.name: [r.to_dict() for r in p.records] for p in phases}})  # fmt: skip
        print(f"wrote {args.json}")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_bench_flags(p)
    return p

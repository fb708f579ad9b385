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

Goodput: a request is good when it succeeded, its TTFT <= --slo-ttft-ms and every one of its
inter-token gaps <= --slo-itl-ms (an SLO not given is not checked). Failed requests are never
good; goodput is good requests per second of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.serve.arrival import Arrival, Concurrency, FixedRate, Poisson, Schedule

if TYPE_CHECKING:
    from bench.serve.client import Endpoint
    from bench.serve.sessions import Session
    from bench.serve.workload import RequestSpec

SESSION_WORKLOADS = ("multi-turn", "shared-prefix", "long-document")
WORKLOADS = ("fixed", "dist", "interference", *SESSION_WORKLOADS, "overload")
ARRIVALS = ("poisson", "rate", "concurrency")


def add_bench_flags(p: argparse.ArgumentParser) -> None:
    """The ``pdserve bench`` / ``python -m bench.serve`` flags."""
    g = p.add_argument_group("server")
    g.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server root or its /v1 URL (default: %(default)s)",
    )
    g.add_argument(
        "--model",
        default=None,
        help="model name sent in requests (default: the first of /v1/models)",
    )
    g.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default=None,
        help="/v1/completions or /v1/chat/completions (default: chat for multi-turn and "
        "shared-prefix, which need it, else completions)",
    )
    g.add_argument(
        "--prompt-format",
        choices=("ids", "text"),
        default="ids",
        help="completions: send prompts as token-id lists or as text (default: %(default)s)",
    )
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ask the server to ignore EOS so outputs have the asked length "
        "(vLLM/llama-server extension; default: on, but off for multi-turn and "
        "shared-prefix, whose answers go back into the conversation as the model ended them)",
    )
    g.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="GGUF file or HF tokenizer directory to build prompts with "
        "(default: pdserve's default model)",
    )
    g.add_argument(
        "--timeout-s",
        type=float,
        default=300.0,
        help="deadline of each request; past it the request is recorded as "
        "failed (default: %(default)s)",
    )

    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="fixed", help="default: %(default)s")
    w.add_argument("--num-requests", type=int, default=32, help="fixed, dist (default: 32)")
    w.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds lengths, filler words and Poisson gaps (nonces stay fresh)",
    )
    w.add_argument(
        "--prompt-tokens",
        type=int,
        default=256,
        help="fixed: prompt length; dist lognormal: median (default: 256)",
    )
    w.add_argument(
        "--output-tokens",
        type=int,
        default=128,
        help="fixed: output length; dist lognormal: median; conversations: each "
        "turn's max_tokens (default: 128)",
    )
    w.add_argument(
        "--dist",
        choices=("uniform", "lognormal"),
        default="uniform",
        help="dist: length distribution (default: %(default)s)",
    )
    w.add_argument(
        "--prompt-range",
        type=int,
        nargs=2,
        default=(64, 1024),
        metavar=("LO", "HI"),
        help="dist: prompt lengths in [LO, HI] (default: 64 1024)",
    )
    w.add_argument(
        "--output-range",
        type=int,
        nargs=2,
        default=(16, 256),
        metavar=("LO", "HI"),
        help="dist: output lengths in [LO, HI] (default: 16 256)",
    )
    w.add_argument("--sigma", type=float, default=0.5, help="dist lognormal: sigma of ln(length)")
    w.add_argument("--streams", type=int, default=8, help="interference: decode streams")
    w.add_argument("--stream-prompt-tokens", type=int, default=32)
    w.add_argument("--stream-output-tokens", type=int, default=256)
    w.add_argument(
        "--stream-stagger-s",
        type=float,
        default=0.01,
        help="interference: stream i starts at i * this",
    )
    w.add_argument("--long-prompt-tokens", type=int, default=1024)
    w.add_argument("--long-output-tokens", type=int, default=16)
    w.add_argument(
        "--long-start-s",
        type=float,
        default=2.0,
        help="interference: first long prompt (default: %(default)s)",
    )
    w.add_argument(
        "--long-every-s",
        type=float,
        default=4.0,
        help="interference: then one every this (default: %(default)s)",
    )
    w.add_argument(
        "--long-count",
        type=int,
        default=None,
        help="interference: this many long prompts (default: until the streams finish)",
    )

    v = p.add_argument_group("overload (--streams clients; --prompt-tokens, --output-tokens)")
    v.add_argument("--flood", type=int, default=48, help="more clients (default: %(default)s)")
    v.add_argument(
        "--stalled", type=int, default=8, help="clients that never read (default: %(default)s)"
    )
    v.add_argument("--huge", type=int, default=3, help="huge prompts (default: %(default)s)")
    v.add_argument("--huge-mib", type=float, default=3.0, help="their size (default: 3 MiB)")
    v.add_argument("--quiet-s", type=float, default=20.0, help="quiet phase (default: 20 s)")
    v.add_argument("--overload-s", type=float, default=30.0, help="overload phase (default: 30 s)")
    v.add_argument(
        "--retry-s",
        type=float,
        default=1.0,
        help="a refused client waits this long before it tries again (default: 1 s, what "
        "pdserve's Retry-After asks)",
    )

    c = p.add_argument_group("conversations (multi-turn, shared-prefix; --output-tokens each)")
    c.add_argument("--sessions", type=int, default=8, help="multi-turn (default: %(default)s)")
    c.add_argument(
        "--turns", type=int, default=4, help="multi-turn: turns a session (default: %(default)s)"
    )
    c.add_argument(
        "--system-prompts", type=int, default=4, help="shared-prefix (default: %(default)s)"
    )
    c.add_argument(
        "--users", type=int, default=32, help="shared-prefix: requests (default: %(default)s)"
    )
    c.add_argument(
        "--system-tokens",
        type=int,
        default=512,
        help="words (one token each) of a system prompt (default: %(default)s)",
    )
    c.add_argument(
        "--rounds",
        action="store_true",
        help="send every session's turn k before any session's turn k+1 (users who come back "
        "after a while: a conversation's KV has left small pools by its next turn)",
    )
    c.add_argument(
        "--document-tokens",
        type=_span,
        default=(2000, 4000),
        metavar="MIN,MAX",
        help="long-document: words of each session's document, drawn in [MIN, MAX] "
        "(default: 2000,4000)",
    )
    c.add_argument(
        "--user-tokens",
        type=int,
        default=64,
        help="words of a user message (default: %(default)s)",
    )

    a = p.add_argument_group("arrival (fixed, dist; conversations: --concurrency)")
    a.add_argument(
        "--arrival",
        choices=ARRIVALS,
        default=None,
        help="poisson at --rate (default), fixed --rate, or closed loop at --concurrency",
    )
    a.add_argument("--rate", type=float, default=1.0, help="requests/s (default: 1)")
    a.add_argument(
        "--concurrency", type=int, default=4, help="in flight, or sessions at once (default: 4)"
    )

    o = p.add_argument_group("SLOs and output")
    o.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=None,
        help="goodput: a good request's TTFT is at most this",
    )
    o.add_argument(
        "--slo-itl-ms",
        type=float,
        default=None,
        help="goodput: every inter-token gap of a good request is at most this",
    )
    o.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="PATH",
        help="write config, every request's record (all token times) and the summaries",
    )
    o.add_argument(
        "--plot-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="write itl_over_time.png and latency_cdf.png here",
    )
    o.add_argument("--label", default="run", help="this run's name in the plots")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def endpoint_from_args(args: argparse.Namespace) -> Endpoint:
    """The endpoint to send to; ``ValueError`` when the workload cannot use the one asked."""
    if args.workload in SESSION_WORKLOADS:
        if args.endpoint == "completions":
            raise ValueError(f"{args.workload} sends chat messages: drop --endpoint completions")
        return "chat"
    return args.endpoint or "completions"


def ignore_eos_from_args(args: argparse.Namespace) -> bool:
    if args.ignore_eos is not None:
        return bool(args.ignore_eos)
    return args.workload not in SESSION_WORKLOADS


def arrival_from_args(args: argparse.Namespace) -> Arrival:
    """The arrival pattern the flags ask for; ``ValueError`` when they do not fit."""
    if args.workload == "interference":
        if args.arrival is not None:
            raise ValueError("the interference workload follows its own schedule: drop --arrival")
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


def _span(text: str) -> tuple[int, int]:
    """``"2000,4000"`` -> ``(2000, 4000)``: a positive MIN,MAX with MIN <= MAX."""
    try:
        low, high = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX, got {text!r}") from None
    if not 0 < low <= high:
        raise argparse.ArgumentTypeError(f"expected 0 < MIN <= MAX, got {text!r}")
    return low, high


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
    import aiohttp

    from bench._common import write_json
    from bench.serve.metrics import Slo, summarize_by_tag
    from bench.serve.report import summary_table
    from bench.serve.reuse import reuse_table, summarize_reuse_by_tag, worker_table
    from bench.serve.runner import run_benchmark
    from bench.serve.session_runner import run_sessions

    if args.workload == "overload":
        return _run_overload(args)
    slo = None
    if args.slo_ttft_ms is not None or args.slo_itl_ms is not None:
        slo = Slo(ttft_ms=args.slo_ttft_ms, itl_ms=args.slo_itl_ms)
    try:
        endpoint = endpoint_from_args(args)
        arrival = arrival_from_args(args)
        ignore_eos = ignore_eos_from_args(args)
        if args.workload in SESSION_WORKLOADS:
            sessions, workload_config = sessions_from_args(args)
            config = {**workload_config, "slo": vars(slo) if slo else None}
            run = run_sessions(
                args.base_url,
                sessions,
                model=args.model,
                concurrency=args.concurrency,
                timeout_s=args.timeout_s,
                progress=not args.no_progress,
                ignore_eos=ignore_eos,
                config=config,
                rounds=args.rounds,
            )
        else:
            specs, workload_config = workload_from_args(args)
            config = {**workload_config, "slo": vars(slo) if slo else None}
            run = run_benchmark(
                args.base_url,
                specs,
                model=args.model,
                arrival=arrival,
                timeout_s=args.timeout_s,
                progress=not args.no_progress,
                endpoint=endpoint,
                prompt_format=args.prompt_format,
                ignore_eos=ignore_eos,
                config=config,
            )
    except ValueError as exc:
        print(f"pdserve bench: {exc}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(run)
    except ValueError as exc:
        print(f"pdserve bench: {exc}", file=sys.stderr)
        return 2
    except (aiohttp.ClientError, OSError, RuntimeError, TimeoutError) as exc:
        print(f"pdserve bench: {args.base_url}: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
    summaries = summarize_by_tag(result, slo)
    reuse = summarize_reuse_by_tag(result)
    cfg = result.config
    dropped = f", {cfg['dropped']} not sent" + (
        " (a turn before failed)"
        if args.workload in SESSION_WORKLOADS
        else " (scheduled after the streams finished)"
    )
    print(
        f"model {cfg['model']} at {args.base_url} ({endpoint}), workload {args.workload}: "
        f"{len(result.records)} requests in {result.duration_s:.2f} s"
        + (dropped if cfg["dropped"] else "")
    )
    print(summary_table(summaries))
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
    return 0 if any(r.ok for r in result.records) else 1


def _run_overload(args: argparse.Namespace) -> int:
    """``--workload overload``: run it, print the figures and the verdict (exit 0 on PASS)."""
    import aiohttp

    from bench._common import write_json
    from bench.serve import overload
    from bench.serve import workload as wl

    try:
        cfg = overload.OverloadConfig(
            streams=args.streams, flood=args.flood, stalled=args.stalled, huge=args.huge,
            huge_mib=args.huge_mib, quiet_s=args.quiet_s, overload_s=args.overload_s,
            retry_s=args.retry_s, timeout_s=args.timeout_s,
        )  # fmt: skip
        specs = wl.build_fixed(
            wl.default_tokenizer(args.tokenizer),
            num_requests=max(args.streams, 1) * 4,
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            seed=args.seed,
        )
        phases = asyncio.run(overload.run_overload(args.base_url, specs, cfg, args.model))
    except ValueError as exc:
        print(f"pdserve bench: {exc}", file=sys.stderr)
        return 2
    except (aiohttp.ClientError, OSError, RuntimeError, TimeoutError) as exc:
        print(f"pdserve bench: {args.base_url}: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
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

"""`pdserve plan`: how many prefill and decode workers a workload needs, and whether one
colocated pool would do better, from a profile measured on this kind of machine.

  pdserve plan profile --out profile.json [--threads N] [--model PATH]
      measure a profile in this process with pdserve's engine (about a minute on 1 thread)
  pdserve plan --profile profile.json --rate R --prompt-tokens P --output-tokens O \\
               --slo-ttft-ms T --slo-itl-ms I [--max-workers N] [--json]
      print the recommendation in words (or JSON)

The model behind the advice (every formula) is in bench/plan/model.py's docstring. Exit
status: 0 with a recommendation (the text says when even the best choice misses the SLOs
within --max-workers); 2 on bad input: a missing or malformed profile, a non-positive
rate, token count or SLO, or SLOs that no deployment meets even at batch 1; 1 when a
measurement fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from bench.plan.measure import (
    DEFAULT_DECODE_BATCHES,
    DEFAULT_DECODE_CONTEXTS,
    DEFAULT_PREFILL_TOKENS,
    TRANSFERS,
    ProfileConfig,
)
from bench.plan.model import DEFAULT_MAX_BATCH, PlanError, Workload, plan
from bench.plan.profile import Profile, ProfileError
from bench.plan.report import format_recommendation

_REQUIRED = (
    ("--profile", "profile"),
    ("--rate", "rate"),
    ("--prompt-tokens", "prompt_tokens"),
    ("--output-tokens", "output_tokens"),
    ("--slo-ttft-ms", "slo_ttft_ms"),
    ("--slo-itl-ms", "slo_itl_ms"),
)


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    """Add the advice flags and the ``profile`` subcommand to ``p`` (``run_plan`` runs it)."""
    p.add_argument("--profile", metavar="FILE", help="profile JSON (from `plan profile`)")
    p.add_argument("--rate", type=float, metavar="R", help="requests per second (Poisson)")
    p.add_argument("--prompt-tokens", type=int, metavar="P", help="prompt tokens per request")
    p.add_argument("--output-tokens", type=int, metavar="O", help="output tokens per request")
    p.add_argument("--slo-ttft-ms", type=float, metavar="T", help="time-to-first-token SLO (mean)")
    p.add_argument("--slo-itl-ms", type=float, metavar="I", help="inter-token latency SLO (P99)")
    p.add_argument("--max-workers", type=int, metavar="N", help="worker budget (default: none)")
    p.add_argument(
        "--max-batch",
        type=int,
        default=DEFAULT_MAX_BATCH,
        metavar="B",
        help=f"largest decode batch to consider (default {DEFAULT_MAX_BATCH})",
    )
    p.add_argument("--json", action="store_true", help="print the recommendation as JSON")
    sub = p.add_subparsers(dest="plan_command", metavar="{profile}")
    prof = sub.add_parser(
        "profile",
        help="measure a profile with pdserve's engine in this process",
        description="Measure prefill time vs prompt length, decode step time vs batch and "
        "context, and KV transfer speed, with pdserve's engine in this process.",
    )
    prof.add_argument("--out", required=True, metavar="FILE", help="where to write the JSON")
    prof.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    prof.add_argument("--model", default=None, help="checkpoint (default: embedded SmolLM2)")
    prof.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    prof.add_argument(
        "--prefill-tokens",
        type=int,
        nargs="+",
        default=list(DEFAULT_PREFILL_TOKENS),
        help=f"prompt lengths (default {' '.join(map(str, DEFAULT_PREFILL_TOKENS))})",
    )
    prof.add_argument(
        "--decode-batches",
        type=int,
        nargs="+",
        default=list(DEFAULT_DECODE_BATCHES),
        help=f"decode batch sizes (default {' '.join(map(str, DEFAULT_DECODE_BATCHES))})",
    )
    prof.add_argument(
        "--decode-contexts",
        type=int,
        nargs="+",
        default=list(DEFAULT_DECODE_CONTEXTS),
        help=f"decode contexts (default {' '.join(map(str, DEFAULT_DECODE_CONTEXTS))})",
    )
    prof.add_argument("--decode-steps", type=int, default=8, help="timed steps per repeat")
    prof.add_argument("--repeats", type=int, default=2, help="repeats per figure (medians)")
    prof.add_argument(
        "--transfer", default="shm", choices=TRANSFERS, help="KV transport to time (default shm)"
    )
    prof.add_argument("--seed", type=int, default=0, help="seed of the random prompts")


def run_plan(args: argparse.Namespace) -> int:
    """Run ``pdserve plan`` (or ``plan profile``) from parsed flags; returns the exit status."""
    try:
        if getattr(args, "plan_command", None) == "profile":
            return _run_profile(args)
        return _run_advice(args)
    except (PlanError, ProfileError) as exc:
        return _error(str(exc), 2)


def _error(message: str, status: int) -> int:
    print(f"pdserve plan: error: {message}", file=sys.stderr)
    return status


def _run_advice(args: argparse.Namespace) -> int:
    missing = [flag for flag, dest in _REQUIRED if getattr(args, dest, None) is None]
    if missing:
        return _error(
            f"missing {', '.join(missing)} (measure a profile first with "
            "`pdserve plan profile --out FILE`)",
            2,
        )
    workload = Workload(
        rate=args.rate,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        slo_ttft_s=args.slo_ttft_ms / 1000.0,
        slo_itl_s=args.slo_itl_ms / 1000.0,
        max_workers=args.max_workers,
        max_batch=args.max_batch,
    )
    profile = Profile.load(args.profile)
    rec = plan(profile, workload)
    if args.json:
        print(json.dumps({"profile_file": args.profile, **rec.to_dict()}, indent=2))
    else:
        print(format_recommendation(rec, profile))
    return 0


def _run_profile(args: argparse.Namespace) -> int:
    try:
        cfg = ProfileConfig(
            threads=args.threads,
            model=args.model,
            dtype=args.dtype,
            prefill_tokens=tuple(args.prefill_tokens),
            decode_batches=tuple(args.decode_batches),
            decode_contexts=tuple(args.decode_contexts),
            decode_steps=args.decode_steps,
            repeats=args.repeats,
            transfer=args.transfer,
            seed=args.seed,
        )
    except ValueError as exc:
        return _error(str(exc), 2)
    from bench.plan.measure import measure_profile
    from engine.errors import EngineError
    from transfer.errors import TransferError

    try:
        profile = measure_profile(cfg)
    except EngineError as exc:  # a bad model path or a grid the engine cannot hold
        return _error(str(exc), 2)
    except (TransferError, RuntimeError) as exc:
        return _error(f"measurement failed: {exc}", 1)
    try:
        profile.save(args.out)
    except OSError as exc:
        return _error(f"cannot write {args.out}: {exc}", 1)
    print(f"wrote {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_plan_flags(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_plan(args)
    except KeyboardInterrupt:
        return 130

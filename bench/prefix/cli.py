"""``python -m bench.prefix``: prefix reuse under round-robin, least-loaded and cache-aware
routing, side by side, each on a fresh ``pdserve up --prefill 2 --decode 2 --routing
<policy>`` stack it starts and stops itself.

Workloads (``pdserve bench``'s, chat, greedy): multi-turn (sessions of turns over one shared
system prompt; each turn is sent with the whole conversation so far, the model's answers
included, once the turn before is answered) and shared-prefix (users over a few system
prompts). Fresh nonces keep runs and sessions apart (bench/serve/sessions.py).

Measured per policy and workload: TTFT, E2E, prompt tokens cached vs computed (the requests'
usage, and each worker's pdserve:prompt_tokens_cached_total / _computed_total), KV bytes per
request (the gateway's "pdserve" object) and per worker (pdserve:kv_transfer_bytes_total).

Targets, shown PASS/FAIL, cache-aware against round-robin: TTFT P50 <= 1/2; prompt tokens
computed <= 1/2; multi-turn: every later turn moves at most its new tokens' KV plus one
block per layer. Writes prefix.json (every request), prefix.md (tables, the command, the
date) and prefix.png to --out, and prints the markdown. The defaults take about 10-15
minutes on 2 cores; exit status 0 when every target passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.prefix.config import POLICIES, WORKLOADS, PrefixConfig


def _csv(choices: Sequence[str]) -> object:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {','.join(choices)}, got {text!r}")
        return items

    return parse


# (flag, PrefixConfig field, help); the type and default come from the field
_STACK = (
    ("--prefill", "prefill", "prefill workers"),
    ("--decode", "decode", "decode workers"),
    ("--kv-cache-mib", "kv_cache_mib", "KV pool of each worker"),
    (
        "--kv-store-segment-mib",
        "kv_store_segment_mib",
        "+store policies: each worker's DRAM in the KV store",
    ),
)
_WORKLOAD = (
    ("--sessions", "mt_sessions", "multi-turn: sessions"),
    ("--turns", "mt_turns", "multi-turn: turns a session"),
    ("--mt-system-tokens", "mt_system_tokens", "multi-turn: the system prompt"),
    ("--mt-user-tokens", "mt_user_tokens", "multi-turn: a user message"),
    ("--system-prompts", "sp_system_prompts", "shared-prefix: system prompts"),
    ("--users", "sp_users", "shared-prefix: users (one request each)"),
    ("--sp-system-tokens", "sp_system_tokens", "shared-prefix: a system prompt"),
    ("--sp-user-tokens", "sp_user_tokens", "shared-prefix: a user message"),
    ("--documents", "ld_sessions", "long-document: sessions, a document each"),
    ("--document-turns", "ld_turns", "long-document: questions a session"),
    ("--min-document-tokens", "ld_min_doc_tokens", "long-document: shortest document"),
    ("--max-document-tokens", "ld_max_doc_tokens", "long-document: longest document"),
    ("--question-tokens", "ld_user_tokens", "long-document: a question"),
    ("--output-tokens", "output_tokens", "max_tokens of every request"),
    ("--concurrency", "concurrency", "sessions (users) at once"),
    ("--timeout-s", "timeout_s", "deadline of each request"),
    ("--seed", "seed", "seeds the filler words (nonces stay fresh)"),
)


def build_parser() -> argparse.ArgumentParser:
    d = PrefixConfig()
    p = argparse.ArgumentParser(
        prog="python -m bench.prefix",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("prefix-bench"),
        help="directory for prefix.json, prefix.md and prefix.png (default: %(default)s)",
    )
    p.add_argument(
        "--policies",
        type=_csv(POLICIES),
        default=d.policies,
        help=f"comma list, in run order (default: {','.join(d.policies)})",
    )
    p.add_argument(
        "--workloads",
        type=_csv(WORKLOADS),
        default=d.workloads,
        help=f"comma list (default: {','.join(d.workloads)})",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    stack = p.add_argument_group("stack")
    workload = p.add_argument_group("workloads (lengths in words, a token each)")
    for group, flags in ((stack, _STACK), (workload, _WORKLOAD)):
        for flag, name, text in flags:
            default = getattr(d, name)
            group.add_argument(
                flag, dest=name, type=type(default), default=default,
                metavar="SECONDS" if isinstance(default, float) else "N",
                help=f"{text} (default: %(default)s)",
            )  # fmt: skip
    stack.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=None,
        metavar="N",
        help="passed to pdserve up (default: pdserve up's own)",
    )
    stack.add_argument("--log-dir", default=None, help="stack logs (default: a new temp dir)")
    return p


def config_from(args: argparse.Namespace) -> PrefixConfig:
    """``ValueError`` for settings that cannot run."""
    fields = {name: getattr(args, name) for _, name, _ in (*_STACK, *_WORKLOAD)}
    return PrefixConfig(
        policies=args.policies,
        workloads=args.workloads,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        log_dir=args.log_dir,
        progress=not args.no_progress,
        **fields,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from(args)
    except ValueError as e:
        print(f"bench.prefix: {e}", file=sys.stderr)
        return 2
    from bench._common import write_json
    from bench.prefix.plots import plot_report
    from bench.prefix.report import PLOT_NAME, render
    from bench.prefix.runner import run

    try:
        report = run(cfg, shlex.join(["python", "-m", "bench.prefix", *argv]))
    except RuntimeError as e:
        print(f"bench.prefix: {e}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "prefix.json", report.to_json())
    plot_report(report, args.out / PLOT_NAME)
    text = render(report)
    (args.out / "prefix.md").write_text(text + "\n")
    print(text)
    print(f"\nwrote {args.out}/prefix.json, prefix.md, {PLOT_NAME}", file=sys.stderr)
    return 0 if all(t.passed is True for t in report.targets) else 1

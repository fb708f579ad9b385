"""``pdserve chaos``: a bounded chaos run against a stack it starts itself.

Starts ``pdserve up``'s stack in this process (2 prefill + 2 decode workers over shm and
tcp, small KV pools), sends ``--requests`` greedy streamed chat requests, at most
``--concurrency`` at once, each with its own deadline (past it: HUNG, and cancelled), while
prefill workers fail KV transfers at ``--fault-rate`` and, with the flags, one prefill
worker, one decode worker and Redis are killed with SIGKILL after 1/3, 1/2 and 2/3 of the
requests; ``pdserve up``'s supervisor restarts them. Then it waits for the KV blocks of the
surviving workers to come back (at most --lease-wait-s), stops the stack, and computes each
question's greedy answer with the engine in this process.

Acceptance (exit status 1 when any fails): 0 hung; >= 99% completed; 0 greedy mismatches
among migrated streams; free KV blocks after = before on every worker that was not killed;
0 bytes of this run's pdserve-kv-* segments left in /dev/shm after the stack stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.chaos.report import acceptance, render
from bench.chaos.runner import ChaosConfig, run


def add_chaos_flags(p: argparse.ArgumentParser) -> None:
    """The ``pdserve chaos`` / ``python -m bench.chaos`` flags."""
    d = ChaosConfig()
    p.add_argument("--requests", type=int, default=d.requests, help="(default: %(default)s)")
    p.add_argument(
        "--concurrency",
        type=int,
        default=d.concurrency,
        help="requests in flight at most (default: %(default)s)",
    )
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="(default: %(default)s)")
    p.add_argument(
        "--deadline-s",
        type=float,
        default=d.deadline_s,
        help="per request: past it the request is HUNG (default: %(default)s)",
    )
    p.add_argument(
        "--fault-rate",
        type=float,
        default=d.fault_rate,
        help="PDSERVE_FAULTS fail_rate of the prefill workers (default: %(default)s)",
    )
    p.add_argument("--fault-seed", type=int, default=d.fault_seed, help="(default: %(default)s)")
    p.add_argument("--kill-prefill", action="store_true", help="kill -9 prefill-0 after 1/3")
    p.add_argument("--kill-decode", action="store_true", help="kill -9 decode-0 after 1/2")
    p.add_argument("--restart-redis", action="store_true", help="kill -9 redis after 2/3")
    p.add_argument(
        "--restart-kv-store",
        action="store_true",
        help="kill -9 the KV store's master after 5/6 (it restarts empty)",
    )
    p.add_argument(
        "--context-words",
        type=int,
        default=d.context_words,
        help="a shared preamble of this many words before every question, so requests "
        "share KV blocks the store serves (default: %(default)s)",
    )
    p.add_argument(
        "--kv-store-segment-mib",
        type=int,
        default=d.kv_store_segment_mib,
        help="each worker's DRAM in the KV store (0: no store; default: %(default)s)",
    )
    p.add_argument(
        "--kv-cache-mib",
        type=int,
        default=d.kv_cache_mib,
        help="KV pool of each worker (default: %(default)s)",
    )
    p.add_argument(
        "--prefill-deadline-s",
        type=float,
        default=d.prefill_deadline_s,
        help="the decode workers' prefill deadline; with 2 s it is the KV lease that holds a "
        "killed prefill worker's destination blocks (default: %(default)s)",
    )
    p.add_argument(
        "--lease-wait-s",
        type=float,
        default=None,
        help="longest wait for free KV blocks after the run (default: the prefill deadline + 5 s)",
    )
    p.add_argument(
        "--transport",
        default=d.transport,
        help="the decode workers' KV transports, a comma list given round-robin "
        "(shm, tcp, mooncake; default: %(default)s)",
    )
    p.add_argument("--log-dir", default=None, help="the stack's logs (default: a new temp dir)")
    p.add_argument("--out", type=Path, default=None, help="write the report as JSON here")


def config_from(args: argparse.Namespace) -> ChaosConfig:
    return ChaosConfig(
        requests=args.requests,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        deadline_s=args.deadline_s,
        fault_rate=args.fault_rate,
        fault_seed=args.fault_seed,
        kill_prefill=args.kill_prefill,
        kill_decode=args.kill_decode,
        restart_redis=args.restart_redis,
        restart_kv_store=args.restart_kv_store,
        context_words=args.context_words,
        kv_store_segment_mib=args.kv_store_segment_mib,
        kv_cache_mib=args.kv_cache_mib,
        prefill_deadline_s=args.prefill_deadline_s,
        lease_wait_s=args.lease_wait_s,
        log_dir=args.log_dir,
        transport=args.transport,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_chaos_flags(p)
    return p


def run_chaos(args: argparse.Namespace) -> int:
    try:
        cfg = config_from(args)
    except ValueError as e:
        print(f"pdserve chaos: {e}", file=sys.stderr)
        return 2
    report = run(cfg)
    print(render(report))
    if args.out is not None:
        args.out.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return 0 if all(acceptance(report).values()) else 1

"""The ``pdserve`` command line.

Subcommands:
  generate   run the colocated engine in this process and stream one completion
  up         start the local stack (redis, scheduler, workers, gateway) as processes
  bench      load-test an OpenAI-compatible server (TTFT, ITL, throughput, goodput)
  plan       size prefill/decode workers for a workload from a measured profile
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from engine.errors import EngineError
from services.common.engine_args import add_engine_flags, engine_config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream one completion from the colocated engine")
    gen.add_argument("prompt", help="the prompt text (a user message with --chat)")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_flags(gen)
    gen.set_defaults(func=_cmd_generate)
    up = sub.add_parser("up", help="start the local stack (redis, scheduler, workers, gateway)",
                        description=_up_doc())  # fmt: skip
    from services.up import add_up_flags

    add_up_flags(up)
    up.set_defaults(func=_cmd_up)
    bench = sub.add_parser("bench", help="load-test an OpenAI-compatible server",
                           description=_bench_doc(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    from bench.serve.cli import add_bench_flags

    add_bench_flags(bench)
    bench.set_defaults(func=_cmd_bench)
    plan = sub.add_parser("plan", help="size prefill/decode workers (or `plan profile`)",
                          description=_plan_doc(),
                          formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    from bench.plan.cli import add_plan_flags

    add_plan_flags(plan)
    plan.set_defaults(func=_cmd_plan)
    return parser


def _bench_doc() -> str:
    from bench.serve import cli

    return cli.__doc__ or ""


def _cmd_bench(args: argparse.Namespace) -> int:
    from bench.serve.cli import run_bench

    return run_bench(args)


def _plan_doc() -> str:
    from bench.plan import cli

    return cli.__doc__ or ""


def _cmd_plan(args: argparse.Namespace) -> int:
    from bench.plan.cli import run_plan

    return run_plan(args)


def _up_doc() -> str:
    from services import up

    return up.__doc__ or ""


def _cmd_up(args: argparse.Namespace) -> int:
    from services.up import run_up

    return run_up(args)


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(engine_config(args))
    prompt = args.prompt
    if args.chat:
        messages = []
        if args.system:
            messages.append({"role": "system", "content": args.system})
        messages.append({"role": "user", "content": prompt})
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    ids = engine.tokenizer.encode(prompt) if args.chat else prompt
    for out in engine.stream(ids, params):
        sys.stdout.write(out.text_delta)
        sys.stdout.flush()
        if out.finished:
            sys.stdout.write("\n")
            sys.stdout.flush()
            print(
                f"[{out.num_output_tokens} tokens, finish_reason={out.finish_reason}]",
                file=sys.stderr,
            )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except EngineError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""The service commands of the ``pdserve`` command line (``pdserve/cli.py`` adds the
bench commands; ``python -m services.cli`` runs these alone).

Subcommands:
  generate   run the colocated engine in this process and stream one completion
  up         start the local stack (redis, scheduler, workers, gateway) as processes
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from engine.engine_config import EngineConfig
from engine.errors import EngineError
from services.common import settings

Registrar = Callable[[Any], None]  # adds subcommands to an argparse subparsers object


def add_commands(sub: Any) -> None:
    """Add ``generate`` and ``up`` to ``sub`` (``ArgumentParser.add_subparsers()``)."""
    gen = sub.add_parser(
        "generate", help="stream one completion from the colocated engine", allow_abbrev=False
    )
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
    settings.add_arguments(gen, EngineConfig)
    gen.set_defaults(func=_cmd_generate, parser=gen)

    from services import up

    up_parser = sub.add_parser(
        "up",
        help="start the local stack (redis, scheduler, workers, gateway)",
        description=up.__doc__,
        epilog=settings.env_help("up"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    settings.add_arguments(up_parser, up.UpConfig)
    up_parser.set_defaults(func=_cmd_up, parser=up_parser)


def _cmd_up(args: argparse.Namespace) -> int:
    from services.up import UpConfig, run_up

    return run_up(settings.from_namespace(UpConfig, "up", args, args.parser))


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(settings.from_namespace(EngineConfig, "generate", args, args.parser))
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


def build_parser(
    description: str | None = __doc__, registrars: Sequence[Registrar] = ()
) -> argparse.ArgumentParser:
    """The command line: ``add_commands`` and then each of ``registrars``."""
    parser = argparse.ArgumentParser(
        prog="pdserve", description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    for register in (add_commands, *registrars):
        register(sub)
    return parser


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the subcommand it names; its exit status."""
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except EngineError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())

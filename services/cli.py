"""The ``pdserve`` command line.

Subcommands:
  generate   run the colocated engine in this process and stream one completion
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from engine.errors import EngineError


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--kv-cache-mib", type=int, default=1024, help="KV pool size in MiB")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument(
        "--chunked-prefill",
        type=int,
        default=0,
        metavar="TOKENS",
        help="split prompts into chunks of this many tokens (0: off)",
    )
    g.add_argument("--no-prefix-caching", action="store_true")


def _engine_config(args: argparse.Namespace):  # -> EngineConfig (lazy import keeps --help fast)
    from engine.llm_engine import EngineConfig

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_mib << 20,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        chunked_prefill=args.chunked_prefill > 0,
        max_num_batched_tokens=args.chunked_prefill or None,
        enable_prefix_caching=not args.no_prefix_caching,
        num_threads=args.threads,
    )


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
    _add_engine_flags(gen)
    gen.set_defaults(func=_cmd_generate)
    return parser


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(_engine_config(args))
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

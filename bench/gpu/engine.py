"""The engine's step times on one device: decode at several batch sizes, and prefill.

    python -m bench.gpu.engine --json gpu-engine.json          # cuda, bf16, the default model
    python -m bench.gpu.engine --device cpu --batches 1 2 --context 64 --prefill-tokens 64 --iters 2

Decode: ``batch`` sequences, each with ``context`` prompt tokens already prefilled, step
together; the figure is the median seconds of one engine step (forward, sampling and the
one read of the sampled ids) and its tokens per second. Prefill: one prompt of
``prefill-tokens`` tokens, median seconds and tokens per second. Greedy, prefix caching
off, so every prefill computes all of its tokens. Times on CUDA are closed by
``torch.cuda.synchronize``; the step's own read of the sampled ids syncs it anyway.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench._common import median, write_json


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _engine(args: argparse.Namespace, max_seqs: int):  # -> LLMEngine (torch stays lazy)
    from engine.llm_engine import EngineConfig, LLMEngine

    tokens = max_seqs * (args.context + args.iters + 4) + args.prefill_tokens + 64
    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        weights="float32",
        num_kv_blocks=-(-tokens // 16) + max_seqs,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max(args.prefill_tokens, max_seqs * args.context, 512),
        prefix_caching=False,
        # room for each prompt and what it generates here (a prefill samples one token)
        max_model_len=max(args.prefill_tokens, args.context + args.iters) + 8,
    )
    return LLMEngine(config)


def _decode_step(engine, batch: int, args: argparse.Namespace) -> float:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.iters + 2, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for r in range(batch):
        engine.add_request([(r * 7919 + i) % vocab for i in range(args.context)], params)
    engine.step()  # the prefills (one batched step), then the first decode step warms up
    engine.step()
    times = []
    for _ in range(args.iters):
        _sync(engine.device)
        start = time.perf_counter()
        engine.step()
        _sync(engine.device)
        times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return median(times)


def _prefill(engine, args: argparse.Namespace) -> float:
    from engine.sampling_params import SamplingParams

    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for i in range(args.iters + 1):  # the first is the warm-up
        prompt = [(i * 31 + j * 17) % vocab for j in range(args.prefill_tokens)]
        _sync(engine.device)
        start = time.perf_counter()
        engine.generate([prompt], params)
        _sync(engine.device)
        times.append(time.perf_counter() - start)
    return median(times[1:])


def run(args: argparse.Namespace) -> dict[str, object]:
    engine = _engine(args, max(args.batches))
    decode = []
    for batch in args.batches:
        seconds = _decode_step(engine, batch, args)
        decode.append({"batch": batch, "step_ms": seconds * 1e3, "tokens_per_s": batch / seconds})
    seconds = _prefill(engine, args)
    return {
        "device": engine.config.device,
        "device_name": torch.cuda.get_device_name(engine.device)
        if engine.device.type == "cuda"
        else "cpu",
        "dtype": engine.config.dtype,
        "model": engine.model_config.name,
        "context": args.context,
        "triton_kernels": engine.model.triton is not None,
        "decode": decode,
        "prefill": {
            "tokens": args.prefill_tokens,
            "ms": seconds * 1e3,
            "tokens_per_s": args.prefill_tokens / seconds,
        },
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu.engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--context", type=int, default=512, help="prompt tokens per decoding row")
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--iters", type=int, default=20, help="timed steps per figure")
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if min(args.batches) < 1 or args.context < 1 or args.prefill_tokens < 1 or args.iters < 1:
        print("batches, context, prefill-tokens and iters must be >= 1", file=sys.stderr)
        return 2
    result = run(args)
    for row in result["decode"]:  # type: ignore[attr-defined]
        print(f"decode batch {row['batch']:>4}: {row['step_ms']:8.2f} ms/step "
              f"{row['tokens_per_s']:10.1f} tok/s")  # fmt: skip
    pre = result["prefill"]
    print(f"prefill {pre['tokens']} tokens: {pre['ms']:.1f} ms, {pre['tokens_per_s']:.0f} tok/s")  # type: ignore[index]
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode at batch B, pdserve beside llama.cpp, interleaved repeat by repeat.

``python -m bench.engine`` measures llama.cpp after pdserve's process has exited, minutes
later. On a host whose speed drifts by a third within minutes (docs/benchmarks.md, "Tried
and reverted: integer products") that drift lands in the ratio. This tool loads pdserve's
engine once, then takes turns, so both systems see the same minutes:

1. one pdserve repeat: B fresh random prompts of ``--context`` tokens prefilled, one untimed
   decode step, then ``--steps`` timed steps of the batch (``bench.engine``'s measurement);
2. one llama.cpp repeat: ``llama-batched-bench -npp context -ntg steps -npl B`` on the same
   GGUF and thread count (its own fresh prompts; its ``t_tg`` is the timed steps).

They never run at once: llama.cpp runs as a subprocess while the engine waits. Reported per
batch: each repeat's step time for both, the medians, and pdserve ÷ llama.cpp per repeat
(its median is the verdict; below 1 means pdserve is faster). Run it as its own process
(``--threads`` sizes torch's pool before any work); ``--json`` writes everything.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench._common import machine_info, markdown_table, median, write_json
from bench.engine import _engine_decode_s, _random_ids, llama_cpp_model
from bench.peers import llama_bench
from bench.peers.llama_bench import LlamaCppError, build_hint
from bench.peers.llama_server import BuildLayout, default_cache_dir
from engine.engine_config import WEIGHT_FORMATS


@dataclass(frozen=True)
class BatchResult:
    """Step times (ms) of each repeat at one batch size, the two systems taking turns."""

    batch: int
    pdserve_ms: tuple[float, ...]
    llama_cpp_ms: tuple[float, ...]

    @property
    def ratios(self) -> tuple[float, ...]:
        """pdserve ÷ llama.cpp, repeat by repeat (ms per step; the batch is the same)."""
        return tuple(p / q for p, q in zip(self.pdserve_ms, self.llama_cpp_ms, strict=True))

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "ratios": list(self.ratios),
            "pdserve_median_ms": median(self.pdserve_ms),
            "llama_cpp_median_ms": median(self.llama_cpp_ms),
            "ratio_median": median(self.ratios),
        }


def format_table(threads: int, results: Sequence[BatchResult]) -> str:
    header = (
        "threads", "batch", "pdserve ms/step (median)", "llama.cpp ms/step (median)",
        "pdserve ÷ llama.cpp (median, range)", "per repeat (pdserve / llama.cpp ms)",
    )  # fmt: skip
    rows = []
    for r in results:
        both = zip(r.pdserve_ms, r.llama_cpp_ms, strict=True)
        pairs = ", ".join(f"{p:.1f}/{q:.1f}" for p, q in both)
        rows.append(
            (
                str(threads),
                str(r.batch),
                f"{median(r.pdserve_ms):.1f}",
                f"{median(r.llama_cpp_ms):.1f}",
                f"{median(r.ratios):.2f}× ({min(r.ratios):.2f}–{max(r.ratios):.2f})",
                pairs,
            )
        )
    return markdown_table(header, rows)


def run(
    *,
    threads: int,
    batches: Sequence[int],
    context: int,
    steps: int,
    repeats: int,
    weights: str,
    model: Path,
    layout: BuildLayout,
    seed: int,
    kv_cache_dtype: str = "float32",
) -> list[BatchResult]:
    """Load the engine once, then alternate one pdserve and one llama.cpp repeat per batch."""
    torch.set_num_threads(threads)
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sampling_params import SamplingParams

    block = 16
    engine = LLMEngine(
        EngineConfig(
            model=str(model),
            block_size=block,
            num_kv_blocks=1 + max(batches) * -(-(context + 2 + steps) // block),
            max_num_seqs=max(batches),
            prefix_caching=False,
            threads=threads,
            weights=weights,
            kv_cache_dtype=kv_cache_dtype,
        )
    )
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    warm = _random_ids(gen, vocab, (min(context, 64),)).tolist()
    engine.generate([warm], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    results = []
    for batch in batches:
        ours: list[float] = []
        theirs: list[float] = []
        for _ in range(repeats):
            prompts = _random_ids(gen, vocab, (batch, context))
            (seconds,) = _engine_decode_s(engine, prompts, steps, 1)
            ours.append(1000.0 * seconds / steps)
            figure = llama_bench.measure_decode(
                model, threads=threads, context=context, gen_tokens=steps, batch=batch,
                layout=layout,
            )  # fmt: skip
            theirs.append(figure.step_ms)
            print(
                f"[bench.decode_ab] batch {batch}: pdserve {ours[-1]:.1f} ms, "
                f"llama.cpp {theirs[-1]:.1f} ms",
                file=sys.stderr,
                flush=True,
            )
        results.append(BatchResult(batch, tuple(ours), tuple(theirs)))
    return results


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.decode_ab",
        description="pdserve's decode step beside llama.cpp's, interleaved repeat by repeat.",
    )
    p.add_argument("--threads", type=int, default=1, help="threads of both (default: 1)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="(default: 1 8)")
    p.add_argument("--context", type=int, default=256, help="prompt tokens (default: 256)")
    p.add_argument("--steps", type=int, default=16, help="timed steps per repeat (default: 16)")
    p.add_argument("--repeats", type=int, default=7, help="turns each (default: 7)")
    p.add_argument(
        "--weights", default="quantized", choices=WEIGHT_FORMATS, help="(default: quantized)"
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="float32",
        choices=("float32", "float16"),
        help="pdserve's KV pool dtype (default: float32; llama.cpp's is float16)",
    )
    p.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M's)")
    p.add_argument(
        "--llama-cpp-dir",
        type=Path,
        default=None,
        help="the build of `python -m bench.peers.llama_server build` "
        "(default: ~/.cache/pdserve/llama.cpp/<version>)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--json", metavar="OUT", help="write results to this JSON file")
    args = p.parse_args(argv)
    for name in ("threads", "context", "steps", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if min(args.batches) < 1:
        p.error("--batches must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    layout = BuildLayout(args.llama_cpp_dir or default_cache_dir())
    if layout.missing():
        print(f"bench.decode_ab: {build_hint(layout)}", file=sys.stderr)
        return 2
    model = llama_cpp_model(args.model)
    if model is None:
        print(f"bench.decode_ab: llama.cpp runs a GGUF; {args.model} is not one", file=sys.stderr)
        return 2
    command = shlex.join(["python", "-m", "bench.decode_ab", *argv])
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    try:
        results = run(
            threads=args.threads, batches=args.batches, context=args.context,
            steps=args.steps, repeats=args.repeats, weights=args.weights, model=model,
            layout=layout, seed=args.seed, kv_cache_dtype=args.kv_cache_dtype,
        )  # fmt: skip
    except (FileNotFoundError, LlamaCppError) as exc:
        print(f"bench.decode_ab: llama.cpp failed: {exc}", file=sys.stderr)
        return 1
    machine = machine_info()
    print(f"command: {command}")
    print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} CPUs; started {started}")
    print(
        f"pdserve weights {args.weights}, KV cache {args.kv_cache_dtype}; "
        f"llama.cpp {layout.batched_bench_binary}"
    )
    print()
    print(format_table(args.threads, results))
    if args.json:
        write_json(
            args.json,
            {
                "command": command,
                "started": started,
                "machine": machine,
                "threads": args.threads,
                "context": args.context,
                "steps": args.steps,
                "weights": args.weights,
                "results": [r.to_json() for r in results],
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

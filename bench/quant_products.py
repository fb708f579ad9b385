"""The packed-weight products of one decode step: the fused kernel against dequantize + GEMM.

``kernels.quant_linear.QuantLinear`` runs a product of up to ``DENSE_ROWS`` rows in the
fused kernel (each dequantized vector shared by 8 rows) and a larger one by dequantizing the
weight into a scratch buffer and calling torch's GEMM (the LM head, larger than the scratch,
a panel of rows at a time). This tool measures both ways at each batch size on the model's
own weights: layer 0's packed matrices, stacked as the model stacks them (qkv, o, gate_up,
down), times the number of layers, plus the LM head once: the products of a decode step.
The two ways take turns repeat by repeat (the host's speed drifts within minutes); reported:
each one's median ms per step, dense ÷ fused per repeat, and which one ``QuantLinear`` picks
at that batch.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from bench._common import machine_info, markdown_table, median, write_json

WAYS = ("fused", "dense")


@dataclass(frozen=True)
class Figure:
    batch: int
    fused_ms: tuple[float, ...]  # one per repeat: the step's products, all layers
    dense_ms: tuple[float, ...]

    @property
    def ratios(self) -> list[float]:
        return [d / f for d, f in zip(self.dense_ms, self.fused_ms, strict=True)]


def run(
    *, model: str | None, threads: int, batches: Sequence[int], repeats: int, seed: int
) -> list[Figure]:
    from engine.checkpoint import load_checkpoint
    from engine.model import LlamaModel
    from kernels.quant_linear import QuantLinear

    torch.set_num_threads(threads)
    ckpt = load_checkpoint(model, quantized=True)
    net = LlamaModel(ckpt.config, ckpt.tensors)
    linears = [m for m in net.layers[0].linears() if isinstance(m, QuantLinear)]
    if not linears:
        raise SystemExit(f"{ckpt.path} has no packed layer weights (not a quantized GGUF)")
    # (the product, how many a step runs): each layer's, and the head's once
    counted = [(m, ckpt.config.num_layers) for m in linears]
    if isinstance(net.lm_head, QuantLinear):
        counted.append((net.lm_head, 1))
    gen = torch.Generator().manual_seed(seed)
    figures = []
    for batch in batches:
        xs = [torch.randn(batch, m.in_features, generator=gen) for m, _ in counted]
        times: dict[str, list[float]] = {w: [] for w in WAYS}
        for _ in range(repeats + 1):  # the first round is a warm-up
            for way in WAYS:
                total = 0.0
                for (m, count), x in zip(counted, xs, strict=True):
                    product = m.fused if way == "fused" else m.dense_gemm
                    t0 = time.perf_counter()
                    product(x)
                    total += count * (time.perf_counter() - t0)
                times[way].append(1000.0 * total)
        figures.append(Figure(batch, tuple(times["fused"][1:]), tuple(times["dense"][1:])))
    return figures


def format_table(figures: Sequence[Figure], dense_rows: int) -> str:
    rows = []
    for f in figures:
        r = f.ratios
        rows.append(
            [
                str(f.batch),
                f"{median(f.fused_ms):.1f}",
                f"{median(f.dense_ms):.1f}",
                f"{median(r):.2f}× ({min(r):.2f}–{max(r):.2f})",
                "dense" if f.batch > dense_rows else "fused",
            ]
        )
    header = [
        "batch", "fused ms/step", "dequantize + GEMM ms/step", "dense ÷ fused (median, range)",
        "QuantLinear runs",
    ]  # fmt: skip
    return markdown_table(header, rows)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="python -m bench.quant_products",
        description="A decode step's packed-weight products: fused kernel vs dequantize+GEMM.",
    )
    p.add_argument("--model", help="a quantized GGUF (default: the embedded SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=1, help="(default: 1)")
    p.add_argument(
        "--batches", type=int, nargs="+", default=[8, 16, 24, 32, 48, 64],
        help="rows per product (default: 8 16 24 32 48 64)",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=7, help="(default: 7)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="write results to this JSON file")
    args = p.parse_args(argv)
    if args.threads < 1 or args.repeats < 1 or min(args.batches) < 1:
        p.error("--threads, --repeats and every --batches value must be >= 1")
    from kernels.quant_linear import QuantLinear

    figures = run(
        model=args.model, threads=args.threads, batches=args.batches, repeats=args.repeats,
        seed=args.seed,
    )  # fmt: skip
    command = shlex.join(["python", "-m", "bench.quant_products", *argv])
    machine = machine_info()
    print(f"command: {command}")
    print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} CPUs; {args.threads} thr")
    print()
    print(format_table(figures, QuantLinear.DENSE_ROWS))
    if args.json:
        write_json(
            args.json,
            {
                "command": command,
                "machine": machine,
                "dense_rows": QuantLinear.DENSE_ROWS,
                "figures": [asdict(f) for f in figures],
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The packed-weight products of one decode step: the fused kernel, the tiled kernel, and
dequantize + torch's GEMM.

``kernels.quant_linear.QuantLinear`` runs a product of up to ``FUSED_ROWS`` rows in the
fused kernel (weights dequantized in registers, each byte read once) and a larger one in the
tiled kernel (a few weight rows dequantized into an L1 tile, a register-blocked kernel over
every input row). The third way is what the tiled kernel replaced: dequantize the whole
weight into a buffer (allocated once per weight) and call torch's GEMM. This tool measures
the three at each batch size on the model's own weights: layer 0's packed matrices, stacked
as the model stacks them (qkv, o, gate_up, down), times the number of layers, plus the LM
head once: the products of a decode step. The ways take turns repeat by repeat (the host's
speed drifts within minutes); reported: each one's median ms per step, the tiled kernel's
time ÷ the others' per repeat, and which kernel ``QuantLinear`` picks at that batch (from
``GEMM_ROWS`` rows, a long prompt's, it runs the third way again, one panel of the weight
at a time and without keeping the buffer).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from bench._common import machine_info, markdown_table, median, write_json

WAYS = ("fused", "tiled", "gemm")


@dataclass(frozen=True)
class Figure:
    batch: int
    fused_ms: tuple[float, ...]  # one per repeat: the step's products, all layers
    tiled_ms: tuple[float, ...]
    gemm_ms: tuple[float, ...]  # dequantize the weight, then torch's GEMM

    def ratios(self, other: str) -> list[float]:
        """The tiled kernel's time ÷ ``other``'s ("fused" or "gemm"), repeat by repeat."""
        theirs = getattr(self, f"{other}_ms")
        return [t / o for t, o in zip(self.tiled_ms, theirs, strict=True)]


def _ways() -> dict[str, Callable[[torch.Tensor, object], torch.Tensor]]:
    from kernels.quant_linear import dequantize, qlinear

    dense: dict[int, torch.Tensor] = {}  # a buffer per weight, allocated once (as a scratch was)

    def gemm(x: torch.Tensor, w: object) -> torch.Tensor:
        buf = dense.get(id(w))
        if buf is None:  # not setdefault: that would allocate on every call
            buf = dense[id(w)] = torch.empty(w.shape)  # type: ignore[attr-defined]
        return torch.nn.functional.linear(x, dequantize(w, out=buf))  # type: ignore[arg-type]

    return {
        "fused": lambda x, w: qlinear(x, w, kernel="fused"),  # type: ignore[arg-type]
        "tiled": lambda x, w: qlinear(x, w, kernel="tiled"),  # type: ignore[arg-type]
        "gemm": gemm,
    }


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
    ways = _ways()
    gen = torch.Generator().manual_seed(seed)
    figures = []
    for batch in batches:
        xs = [torch.randn(batch, m.in_features, generator=gen) for m, _ in counted]
        times: dict[str, list[float]] = {w: [] for w in WAYS}
        for _ in range(repeats + 1):  # the first round is a warm-up
            for way in WAYS:
                total = 0.0
                for (m, count), x in zip(counted, xs, strict=True):
                    t0 = time.perf_counter()
                    ways[way](x, m.weight)
                    total += count * (time.perf_counter() - t0)
                times[way].append(1000.0 * total)
        figures.append(Figure(batch, *(tuple(times[w][1:]) for w in WAYS)))
    return figures


def _ratio_cell(r: list[float]) -> str:
    return f"{median(r):.2f}× ({min(r):.2f}–{max(r):.2f})"


def format_table(figures: Sequence[Figure]) -> str:
    from kernels.quant_linear import kernel_for

    rows = [
        [
            str(f.batch),
            f"{median(f.fused_ms):.1f}",
            f"{median(f.tiled_ms):.1f}",
            f"{median(f.gemm_ms):.1f}",
            _ratio_cell(f.ratios("fused")),
            _ratio_cell(f.ratios("gemm")),
            kernel_for(f.batch),
        ]
        for f in figures
    ]
    header = [
        "batch", "fused ms/step", "tiled ms/step", "dequantize + GEMM ms/step",
        "tiled ÷ fused (median, range)", "tiled ÷ GEMM", "QuantLinear runs",
    ]  # fmt: skip
    return markdown_table(header, rows)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="python -m bench.quant_products",
        description="A decode step's packed-weight products: fused kernel, tiled kernel, "
        "dequantize + GEMM.",
    )
    p.add_argument("--model", help="a quantized GGUF (default: the embedded SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=1, help="(default: 1)")
    p.add_argument(
        "--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64],
        help="rows per product (default: 1 4 8 16 32 64)",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=7, help="(default: 7)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="write results to this JSON file")
    args = p.parse_args(argv)
    if args.threads < 1 or args.repeats < 1 or min(args.batches) < 1:
        p.error("--threads, --repeats and every --batches value must be >= 1")
    from kernels.quant_linear import FUSED_ROWS, GEMM_ROWS

    figures = run(
        model=args.model, threads=args.threads, batches=args.batches, repeats=args.repeats,
        seed=args.seed,
    )  # fmt: skip
    command = shlex.join(["python", "-m", "bench.quant_products", *argv])
    machine = machine_info()
    print(f"command: {command}")
    print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} CPUs; {args.threads} thr")
    print()
    print(format_table(figures))
    if args.json:
        write_json(
            args.json,
            {
                "command": command,
                "machine": machine,
                "fused_rows": FUSED_ROWS,
                "gemm_rows": GEMM_ROWS,
                "figures": [asdict(f) for f in figures],
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

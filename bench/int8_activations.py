"""Experiment (reverted): int8 activations for the packed-weight products.

Prints (1) the time of one decode step's products at the model's shapes, float32 kernel
against the int8-activation kernel, batch 1/8/32, 1 thread; (2) the relative error of the
last-position logits of a 40-token prompt, int8 against float32 activations, all products
and one product kind at a time. ``python -m bench.int8_activations``.
"""

from __future__ import annotations

import time

import torch
from gguf import GGMLQuantizationType as Q

from engine.llm_engine import EngineConfig, LLMEngine
from kernels.quant_linear import QuantizedWeight, qlinear, qlinear_int8
from tests.quant_blocks import random_blocks

SHAPES = [  # name, type, out, in, calls per step
    ("qkv", Q.Q4_1, 960, 576, 30),
    ("o", Q.Q4_1, 576, 576, 30),
    ("gate_up", Q.Q4_1, 3072, 576, 30),
    ("down", Q.Q4_1, 576, 1536, 30),
    ("head", Q.Q8_0, 49152, 576, 1),
]


def _best(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def products() -> None:
    for m in (1, 8, 32):
        total = {"float32": 0.0, "int8": 0.0}
        for _name, qt, n, k, calls in SHAPES:
            w = QuantizedWeight(qt, (n, k), torch.from_numpy(random_blocks(qt, n, k, 0)))
            x = torch.randn(m, k)
            for key, fn in (("float32", qlinear), ("int8", qlinear_int8)):
                total[key] += calls * _best(
                    lambda fn=fn, x=x, w=w: fn(x, w), 3 if calls == 1 else 30
                )
        print(
            f"batch {m}: products of a step {total['float32'] * 1e3:.2f} ms float32, "
            f"{total['int8'] * 1e3:.2f} ms int8 ({total['float32'] / total['int8']:.2f}x)"
        )


def fidelity() -> None:
    ids = list(range(1000, 1040))

    def logits(**kw: object) -> torch.Tensor:
        cfg = EngineConfig(weights="quantized", num_kv_blocks=64, **kw)  # type: ignore[arg-type]
        return LLMEngine(cfg).prompt_logits(ids)

    base = logits()
    err = lambda v: ((v - base).abs().max() / base.abs().max()).item()  # noqa: E731
    print(
        "all products int8: last-position logits relative error "
        f"{err(logits(activations='int8')):.2e}"
    )
    for kind in ("head", "qkv", "o", "gate_up", "down"):
        e = LLMEngine(
            EngineConfig(
                weights="quantized",
                num_kv_blocks=64,
                activations="int8",
                enable_prefix_caching=False,
            )
        )
        for layer in e.model.layers:
            for lin in layer.linears():
                lin.int8_activations = False  # type: ignore[union-attr]
            if kind != "head":
                getattr(layer, kind).int8_activations = True
        e.model.lm_head.int8_activations = kind == "head"  # type: ignore[union-attr]
        print(f"only {kind} int8: {err(e.prompt_logits(ids)):.3e}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    products()
    fidelity()

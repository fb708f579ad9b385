"""The engine's ``cpu_kernels`` setting: off, the model keeps to the torch reference (no
packed linears, no C++ attention, no fused layer ops) and greedy output stays the same (but
at a near-tie: the two paths add float32 terms in different orders)."""

from __future__ import annotations

import pytest

import engine.attention
from engine.sampling_params import SamplingParams
from tests.engine.parity import assert_greedy_equal


def test_cpu_kernels_off_keeps_to_the_reference_with_equal_tokens(
    make_engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    on, off = make_engine(), make_engine(cpu_kernels=False)
    assert on.model.fused and not off.model.fused  # the C++ layer ops, or the torch ops
    assert on.model.lm_head.packed and all(layer.qkv.packed for layer in on.model.layers)
    linears = [off.model.lm_head]
    for layer in off.model.layers:
        linears += [layer.qkv, layer.o, layer.gate_up, layer.down]
    assert not any(lin.packed for lin in linears)

    calls: list[int] = []
    kernel = engine.attention.decode_attention_cpu

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(engine.attention, "decode_attention_cpu", counted)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = ["The capital of France is"]
    want = on.generate(prompt, params)[0].token_ids
    assert calls, "the kernel path is not taken with cpu_kernels on"
    calls.clear()
    got = off.generate(prompt, params)[0].token_ids
    assert calls == []
    assert_greedy_equal(off, prompt, [got], [want])

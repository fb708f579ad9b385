"""Packed quantized weights (``EngineConfig(weights="quantized")``) on the real model and on
tiny GGUFs with mixed types: same tokens as float32 weights and as transformers, a fraction of
the memory, and disaggregated (float32 prefill, quantized decode) equal to colocated."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.checkpoint import Checkpoint, load_checkpoint
from engine.errors import ModelLoadError
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from kernels.quant_linear import QuantizedWeight, dequantize
from tests.engine.parity import Reference, assert_greedy_equal, check_parity, parity_prompts
from tests.engine.test_disagg_roles import _disaggregated
from tests.engine.tiny_models import write_tiny_gguf
from tests.quant_blocks import SCALE_OFFSETS

NEAR_TIE = 1e-3  # relative gap between the top two logits under which float32 order may flip
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def make_quantized(
    quantized_checkpoint: Checkpoint, default_tokenizer: Tokenizer
) -> Callable[..., LLMEngine]:
    def make(**overrides: object) -> LLMEngine:
        overrides = {"num_kv_blocks": 512, "kv_cache_dtype": "float32", **overrides}
        cfg = EngineConfig(weights="quantized", **overrides)  # type: ignore[arg-type]
        return LLMEngine(cfg, checkpoint=quantized_checkpoint, tokenizer=default_tokenizer)

    return make


def test_real_model_keeps_its_blocks_within_the_memory_budget(
    quantized_checkpoint: Checkpoint, make_quantized: Callable[..., LLMEngine]
) -> None:
    reader = gguf.GGUFReader(quantized_checkpoint.path)
    file_tensor_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    packed = [w for w in quantized_checkpoint.tensors.values() if isinstance(w, QuantizedWeight)]
    assert len(packed) == 30 * 7 + 1  # every layer matrix and the (tied) embedding
    engine = make_quantized()
    assert engine.weight_format == "quantized"
    assert engine.model.weight_bytes <= 1.25 * file_tensor_bytes
    assert engine.model.weight_bytes < 0.2 * 621 * 2**20  # float32 weights: 621 MiB


def test_greedy_parity_with_transformers(
    make_quantized: Callable[..., LLMEngine], hf_gguf_model, hf_gguf_references: list[Reference]
) -> None:
    """The 8 parity prompts, 64 greedy tokens each, against transformers on the same GGUF;
    a token may differ only at a near-tie of transformers' own logits (``check_parity``)."""
    engine = make_quantized()
    prompts = parity_prompts(engine.tokenizer)
    check_parity(engine, prompts, hf_gguf_references, near_tie=(hf_gguf_model, NEAR_TIE))


def test_disaggregated_float32_prefill_quantized_decode_equals_colocated(
    make_engine: Callable[..., LLMEngine],
    make_quantized: Callable[..., LLMEngine],
    prompts: list[list[int]],
) -> None:
    # --weights auto: float32 prefill workers, quantized decode and colocated workers.
    quantized, dense = make_quantized(), make_engine()
    colocated = [r.token_ids for r in quantized.generate(prompts, GREEDY)]
    float32 = [r.token_ids for r in dense.generate(prompts, GREEDY)]
    got = _disaggregated(make_engine(num_kv_blocks=64), make_quantized(), prompts, GREEDY)
    # the same weights, summed by the C++ kernels or oneDNN: equal but at a near-tie
    assert_greedy_equal(quantized, prompts, got, colocated)
    assert_greedy_equal(dense, prompts, colocated, float32)


def test_long_prompt_prefill_runs_the_tiled_kernel_and_agrees(
    make_engine: Callable[..., LLMEngine], make_quantized: Callable[..., LLMEngine]
) -> None:
    # 300 tokens: the layers' products run the tiled kernel over several panels of rows;
    # logits still equal the float32 engine's.
    ids = list(range(1000, 1300))
    a, b = make_quantized().prompt_logits(ids), make_engine().prompt_logits(ids)
    assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5


# A Q4_K_M-style mix: K-quants with a Q6_K v and down, a Q8_0 untied head, a Q4_K embedding.
MIXED = {
    "model.embed_tokens.weight": Q.Q4_K,
    "lm_head.weight": Q.Q8_0,
    **{f"model.layers.{i}.self_attn.v_proj.weight": Q.Q6_K for i in range(2)},
    **{f"model.layers.{i}.mlp.down_proj.weight": Q.Q6_K for i in range(2)},
}


def _tiny(path: Path, **kwargs: object) -> Path:
    write_tiny_gguf(path, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=512, **kwargs)  # type: ignore[arg-type]
    return path


@pytest.mark.parametrize(
    ("tensor_type", "types"),
    [(Q.Q4_K, MIXED), (Q.Q4_0, {}), (Q.Q4_1, {}), (Q.Q8_0, {})],
    ids=["k-quant-mix", "q4_0", "q4_1", "q8_0"],
)
def test_tiny_gguf_quantized_equals_float32(
    tmp_path: Path, default_tokenizer: Tokenizer, tensor_type: Q, types: dict[str, Q]
) -> None:
    path = _tiny(tmp_path / "tiny.gguf", tensor_type=tensor_type, tensor_types=types, tie=False)
    engines = {
        w: LLMEngine(
            EngineConfig(model=str(path), num_kv_blocks=64, weights=w, kv_cache_dtype="float32"),
            tokenizer=default_tokenizer,
        )
        for w in ("quantized", "float32")
    }
    assert engines["quantized"].weight_format == "quantized"
    dense = load_checkpoint(path)
    for name, w in load_checkpoint(path, quantized=True).tensors.items():
        if isinstance(w, QuantizedWeight):
            assert torch.equal(dequantize(w), dense.tensors[name]), name  # same numbers
    ids = [[5, 17, 300, 42, 7, 9, 11, 260, 3] * 4, [1, 2, 3]]
    got = {w: [r.token_ids for r in e.generate(ids, GREEDY)] for w, e in engines.items()}
    assert_greedy_equal(engines["float32"], ids, got["quantized"], got["float32"])
    a, b = (engines[w].prompt_logits(ids[0]) for w in ("quantized", "float32"))
    assert ((a - b).abs().max() / b.abs().max()).item() < 1e-4


def test_corrupt_block_in_a_file_is_a_load_error(tmp_path: Path) -> None:
    path = _tiny(tmp_path / "tiny.gguf", tensor_type=Q.Q8_0, tie=True)
    reader = gguf.GGUFReader(path)
    target = next(t for t in reader.tensors if t.name == "blk.1.ffn_up.weight")
    offset = int(target.data_offset) + 5 * 34 + SCALE_OFFSETS[Q.Q8_0][0]
    data = bytearray(path.read_bytes())
    data[offset : offset + 2] = np.array([np.nan], dtype=np.float16).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_up\.weight.*block 5.*corrupt"):
        load_checkpoint(path, quantized=True)


def test_weight_format_falls_back_and_validates() -> None:
    with pytest.raises(ValueError, match="float32"):
        EngineConfig(weights="quantized", dtype="bfloat16")
    with pytest.raises(ValueError, match="weights must be one of"):
        EngineConfig(weights="int8")


def test_reference_mode_serves_float32(
    default_checkpoint: Checkpoint, default_tokenizer: Tokenizer
) -> None:
    # --no-cpu-kernels is the torch-only reference: it loads dense weights even if asked.
    from engine.llm_engine import _weight_format

    assert _weight_format(EngineConfig(weights="quantized", cpu_kernels=False)) == "float32"
    assert _weight_format(EngineConfig(weights="quantized")) == "quantized"
    engine = LLMEngine(
        EngineConfig(weights="quantized", num_kv_blocks=64),
        checkpoint=default_checkpoint,
        tokenizer=default_tokenizer,
    )
    assert engine.weight_format == "float32"  # a dense checkpoint handed in stays dense

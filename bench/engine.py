"""Engine benchmark: pdserve's LLMEngine beside transformers and llama.cpp on the same checkpoint.

Measures, for every thread count, pdserve (once per weight format of ``--weights``) and
transformers in a fresh subprocess (so torch's thread pools are sized before any work and
the runs share no state), then llama.cpp once that process has exited:

- prefill tokens/s: the engine's first step on a fresh random prompt of exactly L tokens
  (prefix caching off), against one transformers forward of the same ids with
  ``use_cache=True, logits_to_keep=1`` (what ``generate`` does for its prefill);
- decode tokens/s at batch B: B sequences with ``--context``-token random prompts are
  prefilled, then ``--decode-steps`` engine steps of the running batch are timed; for
  transformers, ``generate(1 + steps) - generate(1)`` on the same batch, both starting from a
  copy of the KV cache of the prompt minus its last token, so the two calls differ by exactly
  ``steps`` decode steps and neither pays for the prompt;
- the memory-bandwidth floor of a batch-1 decode step: bytes of every weight the step reads
  in that format (``weight_bytes``) divided by the bandwidth of a large ``copy_`` on the
  same thread count, measured in the same process (best of the start and end measurements);
- llama.cpp on the same GGUF and thread count (``bench.peers.llama_bench``): decode at the
  same batch sizes and context, ``decode_steps x repeats`` steps timed together, and prompt
  processing at the same lengths. Not built, or not a GGUF: the run says why and carries on
  without it (``--no-llama-cpp`` skips it).

Figures are medians over ``--repeats``. The parent prints one markdown table (one row per
thread count, weight format, phase and size) and optionally writes JSON (``--json``).
``python -m bench.engine --help`` lists the options.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from bench._common import (
    CopyBandwidth,
    load_average,
    machine_info,
    markdown_table,
    measure_copy_bandwidth,
    median,
    rate,
    ratio,
    write_json,
)
from bench.peers import llama_bench
from bench.peers.llama_bench import LlamaCppError, LlamaCppResult, build_hint
from bench.peers.llama_server import BuildLayout, default_cache_dir
from engine.engine_config import WEIGHT_FORMATS

REPO_ROOT = Path(__file__).resolve().parents[1]

PREFILL_TARGET = 1.0  # pdserve / transformers prefill tokens/s: "at least on par"
DECODE_TARGET = 2.0  # pdserve / transformers decode tokens/s at DECODE_TARGET_BATCH
DECODE_TARGET_BATCH = 32
LLAMA_TARGET = 1.0  # pdserve / llama.cpp decode ms per token at LLAMA_TARGET_BATCHES
LLAMA_TARGET_BATCHES = (1, 8)
FLOOR_TARGET = 1.5  # batch-1 decode step / bandwidth floor

_QUICK = {
    "threads": [1],
    "prefill_lens": [16, 64],
    "batches": [1, 4],
    "context": 32,
    "decode_steps": 4,
    "repeats": 2,
    "copy_mib": 256,
    "weights": ["quantized"],
}
_DEFAULTS = {
    "threads": [1, 2],
    "prefill_lens": [128, 512, 1024, 2048],
    "batches": [1, 8, 32],
    "context": 256,
    "decode_steps": 16,
    "repeats": 3,
    "copy_mib": 1024,
    "weights": ["quantized"],
}


@dataclass(frozen=True)
class BenchConfig:
    """What one benchmark run measures; every thread count runs the same config."""

    threads: tuple[int, ...]
    prefill_lens: tuple[int, ...]
    batches: tuple[int, ...]
    context: int
    decode_steps: int
    repeats: int
    transformers: bool
    weights: tuple[str, ...]
    llama_cpp: bool
    llama_cpp_dir: str | None
    dtype: str
    copy_mib: int
    seed: int
    model: str | None
    kv_cache_dtype: str = "auto"  # pdserve's KV pool (auto: --dtype)
    batch_invariant: bool = False  # pdserve's engines in batch-invariant mode

    def __post_init__(self) -> None:
        positive = {
            "threads": min(self.threads, default=0),
            "prefill_lens": min(self.prefill_lens, default=0),
            "batches": min(self.batches, default=0),
            "context": self.context,
            "decode_steps": self.decode_steps,
            "repeats": self.repeats,
            "copy_mib": self.copy_mib,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be non-empty and >= 1")
        if not self.weights or len(set(self.weights)) != len(self.weights):
            raise ValueError(f"weights must be distinct formats, got {self.weights}")
        unknown = set(self.weights) - set(WEIGHT_FORMATS)
        if unknown:
            raise ValueError(f"weights must be among {WEIGHT_FORMATS}, got {sorted(unknown)}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.batch_invariant and self.weights != ("quantized",):
            raise ValueError("--batch-invariant runs the quantized weights only")

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype)
        assert isinstance(dtype, torch.dtype)
        return dtype


@dataclass(frozen=True)
class PrefillResult:
    """Seconds per repeat of one prefill of ``tokens`` tokens."""

    tokens: int
    seconds: tuple[float, ...]

    @property
    def tok_s(self) -> float:
        return rate(self.tokens, median(self.seconds))

    @property
    def ms_per_token(self) -> float:
        return 1000.0 * median(self.seconds) / self.tokens


@dataclass(frozen=True)
class DecodeResult:
    """Seconds per repeat for ``steps`` decode steps of a batch of ``batch`` sequences."""

    batch: int
    steps: int
    seconds: tuple[float, ...]

    @property
    def step_ms(self) -> float:
        return 1000.0 * median(self.seconds) / self.steps

    @property
    def ms_per_token(self) -> float:
        return self.step_ms / self.batch

    @property
    def tok_s(self) -> float:
        return rate(self.batch * self.steps, median(self.seconds))


@dataclass(frozen=True)
class SystemResult:
    """One system's figures on one thread count: pdserve holding its weights in one format
    (``weights``), or transformers (``weights`` is then its dtype). ``weight_bytes``: what a
    decode step reads (see ``weight_bytes``)."""

    weights: str
    weight_bytes: int
    prefill: tuple[PrefillResult, ...]
    decode: tuple[DecodeResult, ...]

    def prefill_at(self, tokens: int) -> PrefillResult | None:
        return next((p for p in self.prefill if p.tokens == tokens), None)

    def decode_at(self, batch: int) -> DecodeResult | None:
        return next((d for d in self.decode if d.batch == batch), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "weights": self.weights,
            "weight_bytes": self.weight_bytes,
            "prefill": [
                {**asdict(p), "tok_s": p.tok_s, "ms_per_token": p.ms_per_token}
                for p in self.prefill
            ],
            "decode": [
                {
                    **asdict(d),
                    "tok_s": d.tok_s,
                    "step_ms": d.step_ms,
                    "ms_per_token": d.ms_per_token,
                }
                for d in self.decode
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SystemResult:
        return cls(
            weights=data["weights"],
            weight_bytes=data["weight_bytes"],
            prefill=tuple(PrefillResult(p["tokens"], tuple(p["seconds"])) for p in data["prefill"]),
            decode=tuple(
                DecodeResult(d["batch"], d["steps"], tuple(d["seconds"])) for d in data["decode"]
            ),
        )


@dataclass(frozen=True)
class ThreadResult:
    """Everything measured on ``threads`` threads: the child process's pdserve (one entry per
    weight format) and transformers figures, and llama.cpp's, which the parent adds."""

    threads: int
    copy_bytes: int
    copy_best_s: float
    cpu_kernel: bool
    pdserve: tuple[SystemResult, ...]
    transformers: SystemResult | None
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    wall_s: float
    llama_cpp: LlamaCppResult | None = None

    @property
    def copy_bytes_per_s(self) -> float:
        return self.copy_bytes / self.copy_best_s

    def floor_ms(self, weight_bytes: int) -> float:
        """Batch-1 decode step floor: every weight byte read once at copy bandwidth."""
        return 1000.0 * weight_bytes / self.copy_bytes_per_s

    def to_json(self) -> dict[str, Any]:
        """Raw timings plus every derived figure (tokens/s, ms/step, ms/token, floors)."""
        return {
            "threads": self.threads,
            "copy_bytes": self.copy_bytes,
            "copy_best_s": self.copy_best_s,
            "copy_gb_per_s": self.copy_bytes_per_s / 1e9,
            "cpu_kernel": self.cpu_kernel,
            "pdserve": [
                {**s.to_json(), "floor_ms": self.floor_ms(s.weight_bytes)} for s in self.pdserve
            ],
            "transformers": None if self.transformers is None else self.transformers.to_json(),
            "llama_cpp": None if self.llama_cpp is None else self.llama_cpp.to_json(),
            "load_before": list(self.load_before),
            "load_after": list(self.load_after),
            "wall_s": self.wall_s,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ThreadResult:
        hf, llama = data["transformers"], data.get("llama_cpp")
        return cls(
            threads=data["threads"],
            copy_bytes=data["copy_bytes"],
            copy_best_s=data["copy_best_s"],
            cpu_kernel=data["cpu_kernel"],
            pdserve=tuple(SystemResult.from_json(s) for s in data["pdserve"]),
            transformers=None if hf is None else SystemResult.from_json(hf),
            load_before=tuple(data["load_before"]),  # type: ignore[arg-type]
            load_after=tuple(data["load_after"]),  # type: ignore[arg-type]
            wall_s=data["wall_s"],
            llama_cpp=None if llama is None else LlamaCppResult.from_json(llama),
        )


@dataclass(frozen=True)
class Row:
    """One line of the results table: one (threads, weights, phase, size).

    ``vs_transformers`` is pdserve's tokens/s ÷ transformers'; ``vs_llama_cpp`` is pdserve's
    ms per token ÷ llama.cpp's. ``judged`` is the ratio the row's target is judged on (one of
    those, or the step ÷ floor); ``passed`` is None where there is no target or no reference.
    """

    threads: int
    weights: str
    metric: str
    pdserve: str
    transformers: str
    llama_cpp: str
    vs_transformers: float | None
    vs_llama_cpp: float | None
    target: str
    judged: float | None
    passed: bool | None


# -- the table -------------------------------------------------------------------------
class _Figure(Protocol):
    """A throughput figure of any of the three systems."""

    @property
    def tok_s(self) -> float: ...

    @property
    def ms_per_token(self) -> float: ...


def _cell(figure: _Figure | None) -> str:
    return "—" if figure is None else f"{figure.tok_s:.1f} ({figure.ms_per_token:.1f} ms)"


def _ratios(ours: _Figure, hf: _Figure | None, llama: _Figure | None) -> tuple[float | None, ...]:
    """(tokens/s ÷ transformers', ms per token ÷ llama.cpp's)."""
    return (
        ratio(ours.tok_s, None if hf is None else hf.tok_s),
        ratio(ours.ms_per_token, None if llama is None else llama.ms_per_token),
    )


def build_rows(results: Sequence[ThreadResult]) -> list[Row]:
    """The table's rows: for each thread count and pdserve weight format, prefill and decode
    beside transformers and llama.cpp, then the bandwidth floor.

    Targets: prefill >= 1.0x transformers' tokens/s at every length; decode at batch 1 and 8
    <= 1.0x llama.cpp's ms per token; decode at batch 32 >= 2.0x transformers' tokens/s;
    batch-1 step <= 1.5x the floor. A target whose reference is missing is not judged.
    """
    rows: list[Row] = []
    for res in results:
        hf, llama = res.transformers, res.llama_cpp
        for ours in res.pdserve:
            for p in ours.prefill:
                theirs = None if hf is None else hf.prefill_at(p.tokens)
                lp = None if llama is None else llama.prefill_at(p.tokens)
                vs_hf, vs_llama = _ratios(p, theirs, lp)
                rows.append(
                    Row(
                        threads=res.threads,
                        weights=ours.weights,
                        metric=f"prefill {p.tokens} tokens (tok/s, ms/token)",
                        pdserve=_cell(p),
                        transformers=_cell(theirs),
                        llama_cpp=_cell(lp),
                        vs_transformers=vs_hf,
                        vs_llama_cpp=vs_llama,
                        target=f"≥ {PREFILL_TARGET:.2f}× transformers",
                        judged=vs_hf,
                        passed=None if vs_hf is None else vs_hf >= PREFILL_TARGET,
                    )
                )
            for d in ours.decode:
                theirs = None if hf is None else hf.decode_at(d.batch)
                ld = None if llama is None else llama.decode_at(d.batch)
                vs_hf, vs_llama = _ratios(d, theirs, ld)
                target, judged, passed = "—", None, None
                if d.batch in LLAMA_TARGET_BATCHES:
                    target, judged = f"≤ {LLAMA_TARGET:.2f}× llama.cpp", vs_llama
                    passed = None if judged is None else judged <= LLAMA_TARGET
                elif d.batch == DECODE_TARGET_BATCH:
                    target, judged = f"≥ {DECODE_TARGET:.2f}× transformers", vs_hf
                    passed = None if judged is None else judged >= DECODE_TARGET
                rows.append(
                    Row(
                        threads=res.threads,
                        weights=ours.weights,
                        metric=f"decode batch {d.batch} (tok/s, ms/token)",
                        pdserve=_cell(d),
                        transformers=_cell(theirs),
                        llama_cpp=_cell(ld),
                        vs_transformers=vs_hf,
                        vs_llama_cpp=vs_llama,
                        target=target,
                        judged=judged,
                        passed=passed,
                    )
                )
            one = ours.decode_at(1)
            if one is not None:
                floor = res.floor_ms(ours.weight_bytes)
                theirs = None if hf is None else hf.decode_at(1)
                ld = None if llama is None else llama.decode_at(1)
                judged = ratio(one.step_ms, floor)
                rows.append(
                    Row(
                        threads=res.threads,
                        weights=ours.weights,
                        metric="decode batch 1 step ÷ bandwidth floor (ms)",
                        pdserve=f"{one.step_ms:.1f}",
                        transformers=_fmt(None if theirs is None else theirs.step_ms, "{:.1f}"),
                        llama_cpp=_fmt(None if ld is None else ld.step_ms, "{:.1f}"),
                        vs_transformers=None,
                        vs_llama_cpp=None,
                        target=f"≤ {FLOOR_TARGET:.2f}× of {floor:.1f} ms",
                        judged=judged,
                        passed=None if judged is None else judged <= FLOOR_TARGET,
                    )
                )
    return rows


def format_table(rows: Sequence[Row]) -> str:
    header = (
        "threads", "weights", "metric", "pdserve", "transformers", "llama.cpp",
        "÷ transformers (tok/s)", "÷ llama.cpp (ms/token)", "target", "result",
    )  # fmt: skip
    cells = [
        (
            str(r.threads),
            r.weights,
            r.metric,
            r.pdserve,
            r.transformers,
            r.llama_cpp,
            _fmt(r.vs_transformers, "{:.2f}×"),
            _fmt(r.vs_llama_cpp, "{:.2f}×"),
            r.target,
            "—" if r.passed is None else f"{'pass' if r.passed else 'FAIL'} ({r.judged:.2f}×)",
        )
        for r in rows
    ]
    return markdown_table(header, cells)


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else spec.format(value)


# -- the measurements (child process) --------------------------------------------------
def _log(threads: int, message: str) -> None:
    print(f"[bench.engine t={threads}] {message}", file=sys.stderr, flush=True)


def _random_ids(gen: torch.Generator, vocab: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=gen, dtype=torch.int64)


def _load_transformers(path: Path, dtype: torch.dtype) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if path.is_dir():
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=dtype
        )
    return model.eval()


def _hf_prefill_s(model: Any, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(input_ids=ids.unsqueeze(0), use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t0


def _hf_cache(model: Any, ids: torch.Tensor) -> tuple[str, Any]:
    """KV cache of ``ids`` and the keyword generate takes it by (renamed in transformers 5)."""
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    if "cache" in out:
        return "cache", out["cache"]
    return "past_key_values", out["past_key_values"]


def _hf_generate_s(model: Any, ids: torch.Tensor, kw: str, cache: Any, new: int) -> float:
    import transformers

    gen_cfg = transformers.GenerationConfig(
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=new,
        pad_token_id=model.config.eos_token_id,
    )
    fresh = copy.deepcopy(cache)  # generate extends the cache in place
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            generation_config=gen_cfg,
            **{kw: fresh},
        )
        elapsed = time.perf_counter() - t0
    if tuple(out.shape) != (ids.shape[0], ids.shape[1] + new):
        raise RuntimeError(f"generate returned {tuple(out.shape)}, expected {new} new tokens")
    return elapsed


def _engine_prefill_s(engine: Any, ids: list[int]) -> float:
    from engine.sampling_params import SamplingParams

    engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    outs = engine.step()
    elapsed = time.perf_counter() - t0
    if len(outs) != 1 or not outs[0].finished or outs[0].num_cached_tokens != 0:
        raise RuntimeError(f"prefill step was not one uncached full prompt: {outs}")
    return elapsed


def _engine_decode_s(engine: Any, prompts: torch.Tensor, steps: int, repeats: int) -> list[float]:
    """Prefill every prompt, one warm-up decode step, then ``repeats`` timed runs of steps."""
    from engine.sampling_params import SamplingParams

    batch = prompts.shape[0]
    # A batch whose prompts exceed one step's token budget is prefilled over several steps,
    # and its first sequences decode meanwhile: each step starts at least one sequence, so
    # ``batch`` tokens of slack keep every sequence running through the timed steps (the
    # rest is aborted after them).
    params = SamplingParams(
        max_tokens=2 + steps * repeats + batch, temperature=0.0, ignore_eos=True
    )
    for row in prompts.tolist():
        engine.add_request(row, params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(out.request_id for out in engine.step())
    preempted = engine.num_preemptions

    def decode_step() -> None:
        outs = engine.step()
        if len(outs) != batch:
            raise RuntimeError(f"a decode step produced {len(outs)} tokens, expected {batch}")

    decode_step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            decode_step()
        times.append(time.perf_counter() - t0)
    if engine.num_preemptions != preempted:
        raise RuntimeError("the decode batch was preempted while timed")
    for request_id in started:  # the slack is not needed
        engine.abort_request(request_id)
    if engine.has_unfinished():
        raise RuntimeError("the decode batch's requests did not all end")
    return times


def weight_bytes(ckpt: Any, weights: str) -> int:
    """Bytes of every weight a decode step reads, in the format the engine holds them.

    ``float32`` (dense): every checkpoint tensor at the run's dtype. The checkpoint holds
    each weight once (a tied LM head is the embedding), and a step reads all of them: every
    layer matrix and norm, plus the embedding as LM head. ``quantized``: a GGUF's tensors as
    stored (the packed blocks and the float ones), what llama.cpp reads too; a checkpoint
    that is not GGUF has nothing quantized, so it counts as dense.
    """
    if weights == "quantized" and ckpt.format == "gguf":
        import gguf

        return sum(int(t.n_bytes) for t in gguf.GGUFReader(ckpt.path).tensors)
    return sum(t.numel() * t.element_size() for t in ckpt.tensors.values())


@dataclass
class _Prompts:
    """Random token ids from one seeded generator, drawn in the order the bench asks."""

    gen: torch.Generator
    vocab: int

    def __call__(self, shape: tuple[int, ...]) -> torch.Tensor:
        return _random_ids(self.gen, self.vocab, shape)


@dataclass(frozen=True)
class _Systems:
    """What the bench times: pdserve's engine per weight format, and transformers (or None)."""

    engines: dict[str, Any]
    hf: Any

    @property
    def names(self) -> list[str]:
        return [*self.engines, *(["transformers"] if self.hf is not None else [])]


def _engines(cfg: BenchConfig, ckpt: Any, threads: int) -> dict[str, Any]:
    """One engine per weight format of ``cfg``, with room for the largest prefill and for
    every decode batch's contexts; prefix caching off, so every prefill computes."""
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.tokenizer import Tokenizer

    block = 16
    decode_tokens = cfg.context + 2 + cfg.decode_steps * cfg.repeats
    num_blocks = 1 + max(
        -(-(max(cfg.prefill_lens) + 1) // block),
        max(cfg.batches) * -(-decode_tokens // block),
    )
    tokenizer = Tokenizer.from_path(ckpt.path)
    engines: dict[str, Any] = {}
    for weights in cfg.weights:
        engines[weights] = LLMEngine(
            EngineConfig(
                model=str(ckpt.path),
                dtype=cfg.dtype,
                block_size=block,
                num_kv_blocks=num_blocks,
                max_num_seqs=max(cfg.batches),
                prefix_caching=False,
                threads=threads,
                weights=weights,
                kv_cache_dtype=cfg.dtype if cfg.kv_cache_dtype == "auto" else cfg.kv_cache_dtype,
                batch_invariant=cfg.batch_invariant,
            ),
            # The dense checkpoint is float32's weights as they are; any other format is
            # loaded by the engine itself, from the file, the way it holds that format.
            checkpoint=ckpt if weights == "float32" else None,
            tokenizer=tokenizer,
        )
    return engines


def _time_prefill(
    cfg: BenchConfig, threads: int, systems: _Systems, ids: _Prompts
) -> dict[str, list[PrefillResult]]:
    """Seconds of each system's prefill per prompt length; within a repeat every system
    gets the same fresh prompt, one after the other."""
    engines, hf = systems.engines, systems.hf
    prefill: dict[str, list[PrefillResult]] = {name: [] for name in systems.names}
    for length in cfg.prefill_lens:
        times: dict[str, list[float]] = {w: [] for w in prefill}
        for _ in range(cfg.repeats):
            prompt = ids((length,))  # fresh per repeat: nothing cached
            for weights, engine in engines.items():
                times[weights].append(_engine_prefill_s(engine, prompt.tolist()))
            if hf is not None:
                times["transformers"].append(_hf_prefill_s(hf, prompt))
        for name, seconds in times.items():
            prefill[name].append(PrefillResult(length, tuple(seconds)))
        _log(threads, f"prefill {length}: seconds {times}")
    return prefill


def _time_decode(
    cfg: BenchConfig, threads: int, systems: _Systems, ids: _Prompts
) -> dict[str, list[DecodeResult]]:
    """Seconds of ``cfg.decode_steps`` decode steps per batch size and system, each repeat."""
    engines, hf = systems.engines, systems.hf
    decode: dict[str, list[DecodeResult]] = {name: [] for name in systems.names}
    for batch in cfg.batches:
        prompts = ids((batch, cfg.context))
        times: dict[str, list[float]] = {w: [] for w in decode}
        for weights, engine in engines.items():
            times[weights] = _engine_decode_s(engine, prompts, cfg.decode_steps, cfg.repeats)
        if hf is not None:
            kw, cache = _hf_cache(hf, prompts[:, :-1])
            _hf_generate_s(hf, prompts, kw, cache, 2)  # warm-up at this batch shape
            for _ in range(cfg.repeats):
                long = _hf_generate_s(hf, prompts, kw, cache, 1 + cfg.decode_steps)
                short = _hf_generate_s(hf, prompts, kw, cache, 1)
                times["transformers"].append(long - short)
            del cache
            gc.collect()
        for name, seconds in times.items():
            decode[name].append(DecodeResult(batch, cfg.decode_steps, tuple(seconds)))
        _log(threads, f"decode batch {batch}: seconds {times}")
    return decode


def run_threads(cfg: BenchConfig, threads: int) -> ThreadResult:
    """Measure pdserve (each weight format) and transformers on ``threads`` threads in this
    process (call it in a fresh one). Every system gets the same prompts, one after the other
    within each repeat, so drift in the machine's load hits all of them alike."""
    torch.set_num_threads(threads)
    wall0 = time.perf_counter()
    load_before = load_average()
    copies: list[CopyBandwidth] = [measure_copy_bandwidth(cfg.copy_mib << 20)]
    _log(threads, f"copy bandwidth {copies[0].bytes_per_s / 1e9:.2f} GB/s")

    from engine.checkpoint import load_checkpoint
    from engine.sampling_params import SamplingParams
    from kernels.paged_attention import cpu_kernel_available

    ckpt = load_checkpoint(cfg.model, dtype=cfg.torch_dtype)
    engines = _engines(cfg, ckpt, threads)
    kernel = cpu_kernel_available()
    hf = _load_transformers(ckpt.path, cfg.torch_dtype) if cfg.transformers else None
    ids = _Prompts(torch.Generator().manual_seed(cfg.seed * 1000 + threads), ckpt.config.vocab_size)

    # Warm-up (untimed): first-call allocations, oneDNN primitives, the attention kernel.
    warm = ids((min(128, max(cfg.prefill_lens)),))
    for engine in engines.values():
        engine.generate(
            [warm.tolist()], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        )
    if hf is not None:
        _hf_prefill_s(hf, warm)
    _log(threads, f"loaded {list(engines)}; cpu attention kernel: {kernel}")
    systems = _Systems(engines, hf)
    prefill = _time_prefill(cfg, threads, systems, ids)
    decode = _time_decode(cfg, threads, systems, ids)

    pdserve = tuple(
        SystemResult(w, weight_bytes(ckpt, w), tuple(prefill[w]), tuple(decode[w])) for w in engines
    )
    transformers = None
    if hf is not None:
        transformers = SystemResult(
            cfg.dtype,
            weight_bytes(ckpt, "float32"),
            tuple(prefill["transformers"]),
            tuple(decode["transformers"]),
        )
    del systems, engines, engine, hf, ckpt
    gc.collect()
    copies.append(measure_copy_bandwidth(cfg.copy_mib << 20))
    best = min(copies, key=lambda c: c.best_s)
    _log(threads, f"copy bandwidth at end {copies[1].bytes_per_s / 1e9:.2f} GB/s")
    return ThreadResult(
        threads=threads,
        copy_bytes=best.nbytes,
        copy_best_s=best.best_s,
        cpu_kernel=kernel,
        pdserve=pdserve,
        transformers=transformers,
        load_before=load_before,
        load_after=load_average(),
        wall_s=time.perf_counter() - wall0,
    )


# -- the parent process ----------------------------------------------------------------
def _spawn(threads: int, argv: Sequence[str]) -> ThreadResult:
    """Run one thread count in a fresh interpreter; its progress goes to our stderr."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TQDM_DISABLE", "1")
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "bench.engine", *argv]
        cmd += ["--child-threads", str(threads), "--child-out", str(out)]
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, check=False, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"the {threads}-thread run failed (exit {proc.returncode})")
        return ThreadResult.from_json(json.loads(out.read_text()))


def _say(message: str) -> None:
    print(f"[bench.engine] {message}", file=sys.stderr, flush=True)


def llama_cpp_model(model: str | None) -> Path | None:
    """The GGUF llama.cpp runs: ``--model`` when it is a ``.gguf`` file, else the default."""
    if model is None:
        from engine.checkpoint import default_model_path

        return default_model_path()
    path = Path(model).expanduser()
    return path if path.suffix.lower() == ".gguf" and path.is_file() else None


def measure_llama_cpp(
    cfg: BenchConfig, threads: int, layout: BuildLayout
) -> tuple[LlamaCppResult | None, str | None]:
    """llama.cpp's figures on ``threads`` threads for the sizes of ``cfg``, or ``None`` and
    why not (binaries not built, a checkpoint that is not GGUF, a tool that failed): the
    run carries on without them."""
    if layout.missing():
        return None, build_hint(layout)
    model = llama_cpp_model(cfg.model)
    if model is None:
        return None, f"llama.cpp runs a GGUF file only; {cfg.model} is not one"
    try:
        result = llama_bench.measure(
            model,
            threads=threads,
            context=cfg.context,
            gen_tokens=cfg.decode_steps * cfg.repeats,
            batches=cfg.batches,
            prompt_lens=cfg.prefill_lens,
            repeats=cfg.repeats,
            layout=layout,
        )
    except (FileNotFoundError, LlamaCppError) as exc:
        return None, f"llama.cpp on {threads} threads failed: {exc}"
    return result, None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine",
        description="pdserve engine prefill/decode throughput beside transformers and llama.cpp.",
    )
    p.add_argument("--threads", type=int, nargs="+", help="thread counts (default: 1 2)")
    p.add_argument(
        "--prefill-lens", type=int, nargs="+", help="prompt lengths (default: 128 512 1024 2048)"
    )
    p.add_argument("--batches", type=int, nargs="+", help="decode batch sizes (default: 1 8 32)")
    p.add_argument("--context", type=int, help="decode prompt length (default: 256)")
    p.add_argument("--decode-steps", type=int, help="timed decode steps per repeat (default: 16)")
    p.add_argument("--repeats", type=int, help="repeats per figure; medians (default: 3)")
    p.add_argument("--copy-mib", type=int, help="copy-bandwidth buffer, MiB (default: 1024)")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers side")
    p.add_argument(
        "--weights",
        nargs="+",
        choices=WEIGHT_FORMATS,
        help="pdserve weight formats, one row group each (default: quantized)",
    )
    p.add_argument(
        "--no-llama-cpp",
        action="store_true",
        help="skip llama.cpp (llama-batched-bench, llama-bench)",
    )
    p.add_argument(
        "--llama-cpp-dir",
        type=Path,
        default=None,
        help="the llama.cpp build of `python -m bench.peers.llama_server build` "
        "(default: ~/.cache/pdserve/llama.cpp/<version>)",
    )
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "float32", "float16"),
        help="pdserve's KV pool dtype (default: auto, the --dtype)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="pdserve's engines in batch-invariant mode (with --weights quantized)",
    )
    p.add_argument("--model", default=None, help="checkpoint path (default: SmolLM2-135M GGUF)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--json", metavar="OUT", help="write results to this JSON file")
    p.add_argument(
        "--quick", action="store_true", help="tiny sizes, 1 thread, few steps (a smoke test)"
    )
    p.add_argument("--child-threads", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Flags given explicitly win; the rest come from --quick's or the full run's defaults."""
    base = _QUICK if args.quick else _DEFAULTS

    def pick(name: str) -> Any:
        value = getattr(args, name)
        return base[name] if value is None else value

    return BenchConfig(
        threads=tuple(pick("threads")),
        prefill_lens=tuple(pick("prefill_lens")),
        batches=tuple(pick("batches")),
        context=pick("context"),
        decode_steps=pick("decode_steps"),
        repeats=pick("repeats"),
        transformers=not args.no_transformers,
        weights=tuple(pick("weights")),
        llama_cpp=not args.no_llama_cpp,
        llama_cpp_dir=None if args.llama_cpp_dir is None else str(args.llama_cpp_dir),
        dtype=args.dtype,
        copy_mib=pick("copy_mib"),
        seed=args.seed,
        model=args.model,
        kv_cache_dtype=args.kv_cache_dtype,
        batch_invariant=args.batch_invariant,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    cfg = config_from_args(args)
    if args.child_threads is not None:
        if not args.child_out:
            raise SystemExit("--child-threads needs --child-out")
        write_json(args.child_out, run_threads(cfg, args.child_threads).to_json())
        return 0

    command = shlex.join(["python", "-m", "bench.engine", *argv])
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    t0 = time.perf_counter()
    layout = BuildLayout(Path(cfg.llama_cpp_dir) if cfg.llama_cpp_dir else default_cache_dir())
    results: list[ThreadResult] = []
    llama_skipped: list[str] = []
    for threads in cfg.threads:
        res = _spawn(threads, argv)
        if cfg.llama_cpp:  # after the child has exited: the two never share the cores
            llama, why = measure_llama_cpp(cfg, threads, layout)
            if why is not None:
                _say(f"no llama.cpp column: {why}")
                llama_skipped.append(why)
            res = dataclasses.replace(res, llama_cpp=llama)
        results.append(res)
    rows = build_rows(results)
    machine = machine_info()
    print(f"command: {command}")
    print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} CPUs; started {started}")
    for res in results:
        floors = ", ".join(
            f"{s.weights} {s.weight_bytes / 1e6:.1f} MB "
            f"(floor {res.floor_ms(s.weight_bytes):.1f} ms)"
            for s in res.pdserve
        )
        print(
            f"threads {res.threads}: copy {res.copy_bytes_per_s / 1e9:.2f} GB/s, "
            f"weights {floors}, cpu attention kernel {res.cpu_kernel}, load "
            f"{res.load_before[0]:.2f} -> {res.load_after[0]:.2f}, {res.wall_s:.0f} s"
        )
        if res.llama_cpp is not None:
            for line in res.llama_cpp.commands:
                print(f"  llama.cpp: {line}")
    for why in dict.fromkeys(llama_skipped):
        print(f"no llama.cpp column: {why}")
    print()
    print(format_table(rows))
    if args.json:
        write_json(
            args.json,
            {
                "command": command,
                "started": started,
                "wall_s": time.perf_counter() - t0,
                "config": asdict(cfg),
                "machine": machine,
                "results": [res.to_json() for res in results],
                "rows": [asdict(r) for r in rows],
                "llama_cpp_skipped": llama_skipped,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

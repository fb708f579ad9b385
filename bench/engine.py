"""Engine benchmark: pdserve's LLMEngine beside transformers on the same checkpoint.

Measures, for every thread count (each in a fresh subprocess, so torch's thread pools are
sized before any work and the runs share no state):

- prefill tokens/s: the engine's first step on a fresh random prompt of exactly L tokens
  (prefix caching off), against one transformers forward of the same ids with
  ``use_cache=True, logits_to_keep=1`` (what ``generate`` does for its prefill);
- decode tokens/s at batch B: B sequences with ``--context``-token random prompts are
  prefilled, then ``--decode-steps`` engine steps of the running batch are timed; for
  transformers, ``generate(1 + steps) - generate(1)`` on the same batch, both starting from a
  copy of the KV cache of the prompt minus its last token, so the two calls differ by exactly
  ``steps`` decode steps and neither pays for the prompt;
- the memory-bandwidth floor of a batch-1 decode step: bytes of every weight the step reads
  (the tied embedding / LM head once) divided by the bandwidth of a large ``copy_`` on the
  same thread count, measured in the same process (best of the start and end measurements).

Figures are medians over ``--repeats``. The parent prints one markdown table and optionally
writes JSON (``--json``). ``python -m bench.engine --help`` lists the options.
"""

from __future__ import annotations

import argparse
import copy
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
from typing import Any

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

REPO_ROOT = Path(__file__).resolve().parents[1]

PREFILL_TARGET = 1.0  # pdserve / transformers prefill tokens/s: "at least on par"
DECODE_TARGET = 2.0  # pdserve / transformers decode tokens/s at DECODE_TARGET_BATCH
DECODE_TARGET_BATCH = 32
FLOOR_TARGET = 1.5  # batch-1 decode step / bandwidth floor

_QUICK = {
    "threads": [1],
    "prefill_lens": [16, 64],
    "batches": [1, 4],
    "context": 32,
    "decode_steps": 4,
    "repeats": 2,
    "copy_mib": 256,
}
_DEFAULTS = {
    "threads": [1, 2],
    "prefill_lens": [128, 512, 1024, 2048],
    "batches": [1, 8, 32],
    "context": 256,
    "decode_steps": 16,
    "repeats": 3,
    "copy_mib": 1024,
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
    dtype: str
    copy_mib: int
    seed: int
    model: str | None

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
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype)
        assert isinstance(dtype, torch.dtype)
        return dtype


@dataclass(frozen=True)
class PrefillResult:
    """Seconds per repeat for one prompt length; ``transformers_s`` is None when skipped."""

    tokens: int
    pdserve_s: tuple[float, ...]
    transformers_s: tuple[float, ...] | None

    @property
    def pdserve_tok_s(self) -> float:
        return rate(self.tokens, median(self.pdserve_s))

    @property
    def transformers_tok_s(self) -> float | None:
        if self.transformers_s is None:
            return None
        return rate(self.tokens, median(self.transformers_s))


@dataclass(frozen=True)
class DecodeResult:
    """Seconds per repeat for ``steps`` decode steps of a batch of ``batch`` sequences."""

    batch: int
    steps: int
    pdserve_s: tuple[float, ...]
    transformers_s: tuple[float, ...] | None

    @property
    def pdserve_step_ms(self) -> float:
        return 1000.0 * median(self.pdserve_s) / self.steps

    @property
    def pdserve_tok_s(self) -> float:
        return rate(self.batch * self.steps, median(self.pdserve_s))

    @property
    def transformers_step_ms(self) -> float | None:
        if self.transformers_s is None:
            return None
        return 1000.0 * median(self.transformers_s) / self.steps

    @property
    def transformers_tok_s(self) -> float | None:
        if self.transformers_s is None:
            return None
        return rate(self.batch * self.steps, median(self.transformers_s))


@dataclass(frozen=True)
class ThreadResult:
    """Everything one child process measured on ``threads`` threads."""

    threads: int
    copy_bytes: int
    copy_best_s: float
    weight_bytes: int
    cpu_kernel: bool
    prefill: tuple[PrefillResult, ...]
    decode: tuple[DecodeResult, ...]
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    wall_s: float

    @property
    def copy_bytes_per_s(self) -> float:
        return self.copy_bytes / self.copy_best_s

    @property
    def floor_ms(self) -> float:
        """Batch-1 decode step floor: every weight byte read once at copy bandwidth."""
        return 1000.0 * self.weight_bytes / self.copy_bytes_per_s

    def to_json(self) -> dict[str, Any]:
        """Raw timings plus every derived figure (tokens/s, ms/step, floor)."""
        out = asdict(self)
        out["copy_gb_per_s"] = self.copy_bytes_per_s / 1e9
        out["floor_ms"] = self.floor_ms
        out["prefill"] = [
            {
                **asdict(p),
                "pdserve_tok_s": p.pdserve_tok_s,
                "transformers_tok_s": p.transformers_tok_s,
            }
            for p in self.prefill
        ]
        out["decode"] = [
            {
                **asdict(d),
                "pdserve_tok_s": d.pdserve_tok_s,
                "pdserve_step_ms": d.pdserve_step_ms,
                "transformers_tok_s": d.transformers_tok_s,
                "transformers_step_ms": d.transformers_step_ms,
            }
            for d in self.decode
        ]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ThreadResult:
        def opt(values: list[float] | None) -> tuple[float, ...] | None:
            return None if values is None else tuple(values)

        return cls(
            threads=data["threads"],
            copy_bytes=data["copy_bytes"],
            copy_best_s=data["copy_best_s"],
            weight_bytes=data["weight_bytes"],
            cpu_kernel=data["cpu_kernel"],
            prefill=tuple(
                PrefillResult(p["tokens"], tuple(p["pdserve_s"]), opt(p["transformers_s"]))
                for p in data["prefill"]
            ),
            decode=tuple(
                DecodeResult(
                    d["batch"], d["steps"], tuple(d["pdserve_s"]), opt(d["transformers_s"])
                )
                for d in data["decode"]
            ),
            load_before=tuple(data["load_before"]),  # type: ignore[arg-type]
            load_after=tuple(data["load_after"]),  # type: ignore[arg-type]
            wall_s=data["wall_s"],
        )


@dataclass(frozen=True)
class Row:
    """One line of the results table. ``passed`` is None where there is no target to meet."""

    threads: int
    metric: str
    pdserve: str
    transformers: str
    ratio: float | None
    target: str
    passed: bool | None


# -- the table -------------------------------------------------------------------------
def build_rows(results: Sequence[ThreadResult]) -> list[Row]:
    """The table's rows: prefill and decode beside transformers, then the bandwidth floor.

    Ratios are pdserve / transformers for throughput rows and step time / floor for the
    floor row. Targets: prefill ratio >= 1.0 at every length, decode ratio >= 2.0 at batch
    32, batch-1 step <= 1.5x the floor. A target whose reference is missing is not judged.
    """
    rows: list[Row] = []
    for res in results:
        for p in res.prefill:
            r = ratio(p.pdserve_tok_s, p.transformers_tok_s)
            rows.append(
                Row(
                    threads=res.threads,
                    metric=f"prefill {p.tokens} tokens (tok/s)",
                    pdserve=f"{p.pdserve_tok_s:.1f}",
                    transformers=_fmt(p.transformers_tok_s, "{:.1f}"),
                    ratio=r,
                    target=f"≥ {PREFILL_TARGET:.2f}×",
                    passed=None if r is None else r >= PREFILL_TARGET,
                )
            )
        for d in res.decode:
            r = ratio(d.pdserve_tok_s, d.transformers_tok_s)
            has_target = d.batch == DECODE_TARGET_BATCH
            hf = (
                "—"
                if d.transformers_tok_s is None
                else f"{d.transformers_tok_s:.1f} ({d.transformers_step_ms:.1f} ms)"
            )
            rows.append(
                Row(
                    threads=res.threads,
                    metric=f"decode batch {d.batch} (tok/s, ms/step)",
                    pdserve=f"{d.pdserve_tok_s:.1f} ({d.pdserve_step_ms:.1f} ms)",
                    transformers=hf,
                    ratio=r,
                    target=f"≥ {DECODE_TARGET:.2f}×" if has_target else "—",
                    passed=None if r is None or not has_target else r >= DECODE_TARGET,
                )
            )
        one = next((d for d in res.decode if d.batch == 1), None)
        if one is not None:
            r = ratio(one.pdserve_step_ms, res.floor_ms)
            rows.append(
                Row(
                    threads=res.threads,
                    metric="decode batch 1 step ÷ bandwidth floor (ms)",
                    pdserve=f"{one.pdserve_step_ms:.1f}",
                    transformers=_fmt(one.transformers_step_ms, "{:.1f}"),
                    ratio=r,
                    target=f"≤ {FLOOR_TARGET:.2f}× of {res.floor_ms:.1f} ms",
                    passed=None if r is None else r <= FLOOR_TARGET,
                )
            )
    return rows


def format_table(rows: Sequence[Row]) -> str:
    header = ("threads", "metric", "pdserve", "transformers", "ratio", "target", "result")
    cells = [
        (
            str(r.threads),
            r.metric,
            r.pdserve,
            r.transformers,
            _fmt(r.ratio, "{:.2f}×"),
            r.target,
            "—" if r.passed is None else ("pass" if r.passed else "FAIL"),
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
    params = SamplingParams(max_tokens=2 + steps * repeats, temperature=0.0, ignore_eos=True)
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
    if engine.has_unfinished() or engine.num_preemptions != preempted:
        raise RuntimeError("the decode batch did not run to completion without preemption")
    return times


def run_threads(cfg: BenchConfig, threads: int) -> ThreadResult:
    """Measure everything on ``threads`` threads in this process (call it in a fresh one)."""
    torch.set_num_threads(threads)
    wall0 = time.perf_counter()
    load_before = load_average()
    copies: list[CopyBandwidth] = [measure_copy_bandwidth(cfg.copy_mib << 20)]
    _log(threads, f"copy bandwidth {copies[0].bytes_per_s / 1e9:.2f} GB/s")

    from engine.checkpoint import load_checkpoint
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.tokenizer import Tokenizer
    from kernels.paged_attention import cpu_kernel_available

    ckpt = load_checkpoint(cfg.model, dtype=cfg.torch_dtype)
    # The checkpoint holds each weight once (a tied LM head is the embedding), and a decode
    # step reads all of them: every layer matrix and norm, plus the embedding as LM head.
    weight_bytes = sum(t.numel() * t.element_size() for t in ckpt.tensors.values())
    block = 16
    decode_tokens = cfg.context + 2 + cfg.decode_steps * cfg.repeats
    num_blocks = 1 + max(
        -(-(max(cfg.prefill_lens) + 1) // block),
        max(cfg.batches) * -(-decode_tokens // block),
    )
    engine = LLMEngine(
        EngineConfig(
            dtype=cfg.dtype,
            block_size=block,
            num_kv_blocks=num_blocks,
            max_num_seqs=max(cfg.batches),
            enable_prefix_caching=False,
            num_threads=threads,
        ),
        checkpoint=ckpt,
        tokenizer=Tokenizer.from_path(ckpt.path),
    )
    vocab = ckpt.config.vocab_size
    kernel = cpu_kernel_available()
    hf = _load_transformers(ckpt.path, cfg.torch_dtype) if cfg.transformers else None
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + threads)

    # Warm-up (untimed): first-call allocations, oneDNN primitives, the attention kernel.
    warm = _random_ids(gen, vocab, (min(128, max(cfg.prefill_lens)),))
    engine.generate([warm.tolist()], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    if hf is not None:
        _hf_prefill_s(hf, warm)
    _log(threads, f"loaded; cpu attention kernel: {kernel}")

    prefill: list[PrefillResult] = []
    for length in cfg.prefill_lens:
        ours, theirs = [], []
        for _ in range(cfg.repeats):
            ids = _random_ids(gen, vocab, (length,))  # fresh per repeat: nothing cached
            ours.append(_engine_prefill_s(engine, ids.tolist()))
            if hf is not None:
                theirs.append(_hf_prefill_s(hf, ids))
        res = PrefillResult(length, tuple(ours), None if hf is None else tuple(theirs))
        prefill.append(res)
        _log(threads, f"prefill {length}: pdserve {ours} s, transformers {theirs} s")

    decode: list[DecodeResult] = []
    for batch in cfg.batches:
        prompts = _random_ids(gen, vocab, (batch, cfg.context))
        ours = _engine_decode_s(engine, prompts, cfg.decode_steps, cfg.repeats)
        theirs: list[float] = []
        if hf is not None:
            kw, cache = _hf_cache(hf, prompts[:, :-1])
            _hf_generate_s(hf, prompts, kw, cache, 2)  # warm-up at this batch shape
            for _ in range(cfg.repeats):
                long = _hf_generate_s(hf, prompts, kw, cache, 1 + cfg.decode_steps)
                short = _hf_generate_s(hf, prompts, kw, cache, 1)
                theirs.append(long - short)
            del cache
            gc.collect()
        res = DecodeResult(
            batch, cfg.decode_steps, tuple(ours), None if hf is None else tuple(theirs)
        )
        decode.append(res)
        _log(threads, f"decode batch {batch}: pdserve {ours} s, transformers {theirs} s")

    del engine, hf, ckpt
    gc.collect()
    copies.append(measure_copy_bandwidth(cfg.copy_mib << 20))
    best = min(copies, key=lambda c: c.best_s)
    _log(threads, f"copy bandwidth at end {copies[1].bytes_per_s / 1e9:.2f} GB/s")
    return ThreadResult(
        threads=threads,
        copy_bytes=best.nbytes,
        copy_best_s=best.best_s,
        weight_bytes=weight_bytes,
        cpu_kernel=kernel,
        prefill=tuple(prefill),
        decode=tuple(decode),
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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine",
        description="pdserve engine prefill/decode throughput beside transformers.",
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
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
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
        dtype=args.dtype,
        copy_mib=pick("copy_mib"),
        seed=args.seed,
        model=args.model,
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
    results = [_spawn(threads, argv) for threads in cfg.threads]
    rows = build_rows(results)
    machine = machine_info()
    print(f"command: {command}")
    print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} CPUs; started {started}")
    for res in results:
        print(
            f"threads {res.threads}: copy {res.copy_bytes_per_s / 1e9:.2f} GB/s, "
            f"weights {res.weight_bytes / 1e6:.1f} MB, floor {res.floor_ms:.1f} ms, "
            f"cpu attention kernel {res.cpu_kernel}, load "
            f"{res.load_before[0]:.2f} -> {res.load_after[0]:.2f}, {res.wall_s:.0f} s"
        )
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
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

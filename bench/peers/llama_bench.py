"""llama.cpp's own benchmark tools on a GGUF: decode at batch B and prompt processing.

Benchmark-only, like ``bench.peers.llama_server`` (whose ``build`` makes both binaries):

- decode (``llama-batched-bench --output-format jsonl``): for each batch size B, B sequences
  each get their own ``context``-token random prompt (prefilled together, untimed here), then
  ``gen_tokens`` decode steps of all B sequences are timed as one figure (``t_tg``). Each
  sequence has its own KV stream (``--no-kv-unified``), so a step attends over its own cells.
  From ``t_tg``: step ms, ms per token (step ms / B) and tokens/s (B x gen_tokens / t_tg).
- prompt processing (``llama-bench -n 0 -o json``): one fresh prompt of L tokens per
  repetition; tokens/s is the median of its ``samples_ts`` (one per repetition).

Both run on ``threads`` threads (``-t``; batched-bench's prompt threads ``-tb`` too) with
llama.cpp's defaults otherwise (its flash-attention ``auto``, batch 2048, ubatch 512). The
parsers are pure and check that every size asked for is in the output: batched-bench
silently skips a batch whose KV does not fit its ``-c``. Every subprocess has a timeout;
a failure raises ``LlamaCppError``.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench._common import median, rate
from bench.peers.llama_server import BuildLayout, default_cache_dir, slot_ctx_size

TIMEOUT_S = 900.0
KV_ALIGN = 256  # llama.cpp pads each sequence's KV stream to a multiple of 256 cells


class LlamaCppError(RuntimeError):
    """A llama.cpp tool failed, timed out, or printed output without the figures asked for."""


@dataclass(frozen=True)
class DecodeFigure:
    """``gen_tokens`` decode steps of ``batch`` sequences after ``context``-token prompts."""

    batch: int
    context: int
    gen_tokens: int
    tg_s: float

    @property
    def step_ms(self) -> float:
        return 1000.0 * self.tg_s / self.gen_tokens

    @property
    def ms_per_token(self) -> float:
        return self.step_ms / self.batch

    @property
    def tok_s(self) -> float:
        return rate(self.batch * self.gen_tokens, self.tg_s)


@dataclass(frozen=True)
class PrefillFigure:
    """Prompt processing of ``tokens`` tokens: tokens/s of each repetition."""

    tokens: int
    samples_tok_s: tuple[float, ...]

    @property
    def tok_s(self) -> float:
        return median(self.samples_tok_s)

    @property
    def ms_per_token(self) -> float:
        return 1000.0 / self.tok_s


@dataclass(frozen=True)
class LlamaCppResult:
    """Everything llama.cpp measured on one thread count, and the commands that did it."""

    threads: int
    decode: tuple[DecodeFigure, ...]
    prefill: tuple[PrefillFigure, ...]
    commands: tuple[str, ...]

    def decode_at(self, batch: int) -> DecodeFigure | None:
        return next((d for d in self.decode if d.batch == batch), None)

    def prefill_at(self, tokens: int) -> PrefillFigure | None:
        return next((p for p in self.prefill if p.tokens == tokens), None)

    def to_json(self) -> dict[str, Any]:
        """Raw figures plus the derived ones (step ms, ms per token, tokens/s)."""
        out = asdict(self)
        out["decode"] = [
            {**asdict(d), "step_ms": d.step_ms, "ms_per_token": d.ms_per_token, "tok_s": d.tok_s}
            for d in self.decode
        ]
        out["prefill"] = [
            {**asdict(p), "tok_s": p.tok_s, "ms_per_token": p.ms_per_token} for p in self.prefill
        ]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LlamaCppResult:
        return cls(
            threads=data["threads"],
            decode=tuple(
                DecodeFigure(d["batch"], d["context"], d["gen_tokens"], d["tg_s"])
                for d in data["decode"]
            ),
            prefill=tuple(
                PrefillFigure(p["tokens"], tuple(p["samples_tok_s"])) for p in data["prefill"]
            ),
            commands=tuple(data["commands"]),
        )


# ---- pure parts ---------------------------------------------------------------------------


def _positive(name: str, values: Sequence[int]) -> None:
    if not values or min(values) < 1:
        raise ValueError(f"{name} must be non-empty and >= 1, got {list(values)}")


def batched_bench_ctx(context: int, gen_tokens: int, batches: Sequence[int]) -> int:
    """``-c`` that fits the largest batch: every sequence gets ``context + gen_tokens`` cells
    rounded up to llama.cpp's per-sequence padding."""
    _positive("batches", batches)
    return max(batches) * slot_ctx_size(context, gen_tokens, KV_ALIGN)


def batched_bench_command(
    binary: Path,
    model: Path,
    *,
    threads: int,
    context: int,
    gen_tokens: int,
    batches: Sequence[int],
) -> list[str]:
    """``llama-batched-bench``: decode speed at each of ``batches``, JSON lines out."""
    _positive("threads/context/gen_tokens", (threads, context, gen_tokens))
    return [
        str(binary),
        "--model", str(model),
        "--ctx-size", str(batched_bench_ctx(context, gen_tokens, batches)),
        "--no-kv-unified",
        "-npp", str(context),
        "-ntg", str(gen_tokens),
        "-npl", ",".join(map(str, batches)),
        "--threads", str(threads),
        "--threads-batch", str(threads),
        "--output-format", "jsonl",
    ]  # fmt: skip


def llama_bench_command(
    binary: Path, model: Path, *, threads: int, prompt_lens: Sequence[int], repeats: int
) -> list[str]:
    """``llama-bench``: prompt processing at each of ``prompt_lens`` (no generation), JSON out."""
    _positive("prompt_lens", prompt_lens)
    _positive("threads/repeats", (threads, repeats))
    return [
        str(binary),
        "--model", str(model),
        "--n-prompt", ",".join(map(str, prompt_lens)),
        "--n-gen", "0",
        "--threads", str(threads),
        "--repetitions", str(repeats),
        "--output", "json",
    ]  # fmt: skip


def parse_batched_bench(
    text: str, *, threads: int, context: int, gen_tokens: int, batches: Sequence[int]
) -> tuple[DecodeFigure, ...]:
    """The figures of each of ``batches``, in that order, from batched-bench's JSON lines.

    Other lines (logs) are ignored. Raises ``LlamaCppError`` when a batch asked for is
    missing (its KV did not fit ``-c``), or a line reports other sizes or thread counts.
    """
    found: dict[int, DecodeFigure] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
            pp, tg, pl, t_tg = int(row["pp"]), int(row["tg"]), int(row["pl"]), float(row["t_tg"])
            n_threads, n_threads_batch = int(row["n_threads"]), int(row["n_threads_batch"])
        except (ValueError, KeyError, TypeError) as exc:
            raise LlamaCppError(f"bad batched-bench line {line!r}: {exc}") from exc
        if (pp, tg) != (context, gen_tokens) or pl not in batches:
            raise LlamaCppError(f"batched-bench ran pp={pp} tg={tg} B={pl}, not asked: {line}")
        if (n_threads, n_threads_batch) != (threads, threads):
            raise LlamaCppError(f"batched-bench ran on {n_threads} threads, not {threads}")
        if t_tg <= 0:
            raise LlamaCppError(f"batched-bench reported t_tg {t_tg}: {line}")
        found[pl] = DecodeFigure(batch=pl, context=pp, gen_tokens=tg, tg_s=t_tg)
    missing = [b for b in batches if b not in found]
    if missing:
        raise LlamaCppError(f"batched-bench printed no figures for batch {missing}")
    return tuple(found[b] for b in batches)


def parse_llama_bench(
    text: str, *, threads: int, prompt_lens: Sequence[int]
) -> tuple[PrefillFigure, ...]:
    """The figures of each of ``prompt_lens``, in that order, from ``llama-bench -o json``.

    Raises ``LlamaCppError`` on output that is not its JSON array, a length asked for that is
    missing, a test with generated tokens, or another thread count.
    """
    start = text.find("[")
    try:
        tests = json.loads(text[start:]) if start >= 0 else None
    except ValueError as exc:
        raise LlamaCppError(f"llama-bench output is not JSON: {exc}") from exc
    if not isinstance(tests, list):
        raise LlamaCppError(f"llama-bench printed no JSON array: {text[-500:]!r}")
    found: dict[int, PrefillFigure] = {}
    for test in tests:
        try:
            tokens, gen = int(test["n_prompt"]), int(test["n_gen"])
            n_threads = int(test["n_threads"])
            samples = tuple(float(s) for s in test["samples_ts"])
        except (ValueError, KeyError, TypeError) as exc:
            raise LlamaCppError(f"bad llama-bench test {test!r}: {exc}") from exc
        if gen != 0 or tokens not in prompt_lens:
            raise LlamaCppError(f"llama-bench ran p={tokens} n={gen}, not asked")
        if n_threads != threads:
            raise LlamaCppError(f"llama-bench ran on {n_threads} threads, not {threads}")
        if not samples or min(samples) <= 0:
            raise LlamaCppError(f"llama-bench p={tokens}: bad samples {samples}")
        found[tokens] = PrefillFigure(tokens=tokens, samples_tok_s=samples)
    missing = [n for n in prompt_lens if n not in found]
    if missing:
        raise LlamaCppError(f"llama-bench printed no figures for prompt length {missing}")
    return tuple(found[n] for n in prompt_lens)


def build_hint(layout: BuildLayout) -> str:
    """What to run when the binaries are missing."""
    missing = ", ".join(p.name for p in layout.missing())
    return (
        f"llama.cpp tools not built ({missing} missing in {layout.build_dir / 'bin'}): run "
        "`python -m bench.peers.llama_server build` (~8 minutes on 2 cores)"
    )


# ---- running ------------------------------------------------------------------------------


def _run(cmd: list[str], timeout_s: float) -> str:
    try:
        proc = subprocess.run(
            cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s,
            check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise LlamaCppError(f"{Path(cmd[0]).name} timed out after {timeout_s:.0f} s") from exc
    except OSError as exc:
        raise LlamaCppError(f"{cmd[0]}: {exc}") from exc
    if proc.returncode != 0:
        raise LlamaCppError(f"{Path(cmd[0]).name} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stdout


def _decode(
    model: Path,
    layout: BuildLayout,
    *,
    threads: int,
    context: int,
    gen_tokens: int,
    batches: Sequence[int],
    timeout_s: float,
) -> tuple[tuple[DecodeFigure, ...], list[str]]:
    """One batched-bench run over ``batches``: its figures and the command that ran."""
    cmd = batched_bench_command(
        layout.batched_bench_binary, model, threads=threads, context=context,
        gen_tokens=gen_tokens, batches=batches,
    )  # fmt: skip
    figures = parse_batched_bench(
        _run(cmd, timeout_s), threads=threads, context=context, gen_tokens=gen_tokens,
        batches=batches,
    )  # fmt: skip
    return figures, cmd


def measure_decode(
    model: Path,
    *,
    threads: int,
    context: int,
    gen_tokens: int,
    batch: int,
    layout: BuildLayout | None = None,
    timeout_s: float = TIMEOUT_S,
) -> DecodeFigure:
    """One batched-bench run at one batch size: fresh prompts, ``gen_tokens`` timed steps.

    Raises like ``measure``."""
    layout = layout or BuildLayout(default_cache_dir())
    if layout.missing():
        raise FileNotFoundError(build_hint(layout))
    (figure,), _ = _decode(
        model, layout, threads=threads, context=context, gen_tokens=gen_tokens,
        batches=[batch], timeout_s=timeout_s,
    )  # fmt: skip
    return figure


def measure(
    model: Path,
    *,
    threads: int,
    context: int,
    gen_tokens: int,
    batches: Sequence[int],
    prompt_lens: Sequence[int],
    repeats: int,
    layout: BuildLayout | None = None,
    timeout_s: float = TIMEOUT_S,
) -> LlamaCppResult:
    """Run batched-bench, then llama-bench, on ``model`` with ``threads`` threads.

    ``layout`` defaults to the cached build of ``bench.peers.llama_server``. Raises
    ``FileNotFoundError`` (with ``build_hint``) when a binary is missing and
    ``LlamaCppError`` when a tool fails, times out (``timeout_s`` each) or prints no figures.
    """
    layout = layout or BuildLayout(default_cache_dir())
    if layout.missing():
        raise FileNotFoundError(build_hint(layout))
    decode, decode_cmd = _decode(
        model, layout, threads=threads, context=context, gen_tokens=gen_tokens,
        batches=batches, timeout_s=timeout_s,
    )  # fmt: skip
    prefill_cmd = llama_bench_command(
        layout.bench_binary, model, threads=threads, prompt_lens=prompt_lens, repeats=repeats
    )
    prefill = parse_llama_bench(
        _run(prefill_cmd, timeout_s), threads=threads, prompt_lens=prompt_lens
    )
    return LlamaCppResult(
        threads=threads,
        decode=decode,
        prefill=prefill,
        commands=(" ".join(decode_cmd), " ".join(prefill_cmd)),
    )

"""The grammar mask's cost per decode step: xgrammar against llguidance on this CPU.

``python -m bench.grammar`` builds each library's tokenizer view from the default model's
tokenizer, compiles a few JSON schemas (flat to nested) and ``json_object``, then walks B
matchers (one per row) through a decode: each step computes the B next-token masks, applies
them to ``[B, vocab]`` float32 logits (disallowed -> -inf) and advances every matcher by the
masked argmax of random logits. Timed per step: mask + apply + advance (the argmax is the
sampler's and is left out). A matcher whose grammar completes starts over. Reported per
library, per schema and B: the median and p90 step time, and the compile time (cold: a
fresh compiler per schema).

``--itl`` measures what the mask costs the streams beside constrained ones: a colocated
engine decodes ``--itl-batch`` unconstrained streams beside as many more, unconstrained
(A) or held by a long JSON schema (B), taking turns A, B, A, B, ...; reported per turn: the
median decode step time (every stream's inter-token latency in that batch).

The engine uses llguidance (``engine.grammar``): the figures and the reason are in
docs/benchmarks.md, "Structured outputs: the grammar mask".
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from bench._common import machine_info, markdown_table, median, percentile, write_json
from engine.checkpoint import default_model_path
from engine.grammar import apply_bitmask
from engine.tokenizer import Tokenizer

SCHEMAS: dict[str, dict[str, Any] | None] = {
    "json_object": None,
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "ok"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string"},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                    },
                },
                "required": ["id", "tags", "address"],
            },
            "kind": {"enum": ["a", "b", "c"]},
        },
        "required": ["user", "kind"],
    },
    "deep": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "n": {"type": "number"},
                        "children": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "label": {"type": "string"},
                                    "score": {"type": "number", "minimum": 0},
                                },
                                "required": ["label"],
                            },
                        },
                    },
                    "required": ["n", "children"],
                },
            }
        },
        "required": ["items"],
    },
}


class Backend(Protocol):
    name: str

    def compile(self, schema: dict[str, Any] | None) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, matchers: Sequence[Any], bitmask: torch.Tensor) -> None: ...
    def accept(self, matcher: Any, token: int) -> None: ...
    def done(self, matcher: Any) -> bool: ...


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer, vocab: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        vocab_bytes = [tok.token_bytes(i) for i in range(tok.vocab_size)]
        self.info = xgr.TokenizerInfo(
            vocab_bytes, xgr.VocabType.RAW, vocab_size=vocab,
            stop_token_ids=sorted(tok.eos_token_ids),
        )  # fmt: skip

    def compile(self, schema: dict[str, Any] | None) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        if schema is None:
            return compiler.compile_builtin_json_grammar()
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: Sequence[Any], bitmask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)

    def accept(self, matcher: Any, token: int) -> None:
        assert matcher.accept_token(token)

    def done(self, matcher: Any) -> bool:
        return matcher.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok: Tokenizer, vocab: int) -> None:
        import llguidance

        from engine.grammar import fill_bitmask, lltokenizer

        self.llg = llguidance
        self.fill_bitmask = fill_bitmask
        self.tokenizer = lltokenizer(tok, vocab)

    def compile(self, schema: dict[str, Any] | None) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            {"type": "object"} if schema is None else schema
        )
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)  # llguidance compiles lazily
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.llg.LLMatcher(self.tokenizer, compiled)

    def fill(self, matchers: Sequence[Any], bitmask: torch.Tensor) -> None:
        self.fill_bitmask(matchers, bitmask)

    def accept(self, matcher: Any, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()

    def done(self, matcher: Any) -> bool:
        return matcher.is_stopped()


@dataclass(frozen=True)
class Figure:
    library: str
    schema: str
    batch: int
    step_ms_median: float
    step_ms_p90: float
    apply_ms_median: float  # of the step: the -inf fill over [B, vocab] (shared code)
    compile_ms: float


def _walk(
    backend: Backend, compiled: Any, batch: int, vocab: int, steps: int
) -> tuple[list[float], list[float]]:
    """Per-step seconds of mask + apply + advance over ``steps`` steps of ``batch`` rows,
    and of the apply alone."""
    gen = torch.Generator().manual_seed(0)
    matchers = [backend.matcher(compiled) for _ in range(batch)]
    bitmask = torch.zeros((batch, (vocab + 31) // 32), dtype=torch.int32)
    times, applies = [], []
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=gen)
        t0 = time.perf_counter()
        backend.fill(matchers, bitmask)
        ta = time.perf_counter()
        apply_bitmask(logits, bitmask)
        t1 = time.perf_counter()
        applies.append(t1 - ta)
        tokens = torch.argmax(logits, dim=-1).tolist()
        t2 = time.perf_counter()
        for m, t in zip(matchers, tokens, strict=True):
            backend.accept(m, t)
        times.append(time.perf_counter() - t2 + t1 - t0)
        matchers = [backend.matcher(compiled) if backend.done(m) else m for m in matchers]
    return times, applies


def measure(
    backends: Sequence[Callable[[Tokenizer, int], Backend]],
    batches: Sequence[int],
    steps: int,
) -> list[Figure]:
    tok = Tokenizer.from_path(default_model_path())
    vocab = tok.vocab_size
    figures = []
    for make in backends:
        backend = make(tok, vocab)
        for name, schema in SCHEMAS.items():
            t0 = time.perf_counter()
            compiled = backend.compile(schema)
            compile_ms = (time.perf_counter() - t0) * 1e3
            for batch in batches:
                times, applies = _walk(backend, compiled, batch, vocab, steps)
                ms = [t * 1e3 for t in times[2:]]  # the first steps warm caches
                apply_ms = median([t * 1e3 for t in applies[2:]])
                figures.append(
                    Figure(backend.name, name, batch, median(ms), percentile(ms, 90), apply_ms,
                           compile_ms)
                )  # fmt: skip
    return figures


# Keeps a stream constrained for at least 128 tokens: 64 integers.
_LONG = {"type": "array", "items": {"type": "integer"}, "minItems": 64}


def itl_turns(batch: int, steps: int, turns: int) -> list[tuple[str, float]]:
    """(``"plain"`` or ``"beside constrained"``, median step seconds) per turn."""
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.structured import StructuredKind, StructuredOutput

    engine = LLMEngine(
        EngineConfig(
            weights="float32", kv_cache_dtype="float32", num_kv_blocks=1024, max_num_seqs=2 * batch
        )
    )
    tok = engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Count."}]))
    plain = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    held = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(_LONG))
    out = []
    for turn in range(2 * turns):
        constrained = turn % 2 == 1
        other = SamplingParams(max_tokens=steps + 1, temperature=0, structured=held)
        for i in range(2 * batch):
            engine.add_request(prompt, other if constrained and i % 2 else plain)
        engine.step()  # the prefills
        times = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        out.append(("beside constrained" if constrained else "plain", median(times)))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--library", choices=["xgrammar", "llguidance"], nargs="+",
                    default=["xgrammar", "llguidance"])  # fmt: skip
    ap.add_argument("--json", default=None, help="write the figures and the machine here")
    ap.add_argument("--itl", action="store_true", help="the ITL of streams beside constrained")
    ap.add_argument("--itl-batch", type=int, default=8)
    ap.add_argument("--itl-turns", type=int, default=3)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.itl:
        turns = itl_turns(args.itl_batch, args.steps, args.itl_turns)
        rows = [[str(i), kind, f"{s * 1e3:.1f}"] for i, (kind, s) in enumerate(turns)]
        print(markdown_table(["turn", "the other streams", "median step ms"], rows))
        return 0
    makers = {"xgrammar": XGrammar, "llguidance": LLGuidance}
    figures = measure([makers[n] for n in args.library], args.batch, args.steps)
    rows = [
        [f.library, f.schema, str(f.batch), f"{f.step_ms_median:.3f}", f"{f.step_ms_p90:.3f}",
         f"{f.apply_ms_median:.3f}", f"{f.compile_ms:.1f}"]
        for f in figures
    ]  # fmt: skip
    header = ["library", "schema", "B", "step ms (median)", "step ms (p90)", "of which apply ms",
              "compile ms"]  # fmt: skip
    print(markdown_table(header, rows))
    if args.json:
        write_json(args.json, {"machine": machine_info(), "figures": [asdict(f) for f in figures]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

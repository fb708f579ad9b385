"""Structured outputs: a request's ``StructuredOutput`` compiled into a grammar, one matcher
per sequence, and the mask that keeps a sequence's next token inside its grammar.

The grammar library is llguidance: per decode step it computed and applied the mask for
less than xgrammar did on this CPU, compiled faster, and it has no dependencies
(docs/benchmarks.md, "Structured outputs: the grammar mask").

Lifecycle (the engine drives it):

1. ``engine.grammar_text.check(structured)``: the grammar text, validated tokenizer-free;
   a bad schema, regex or grammar is an ``InvalidRequestError`` naming the problem (the
   gateway calls it too, so an HTTP client gets a 400 before any worker sees it).
2. ``Grammars.matcher(structured, resumed)``: a sequence's fresh ``Matcher``, with a
   migrated request's output tokens so far replayed, so it stands where the previous
   worker's stood.
3. ``mask(logits, seqs)``: after the penalties, each constrained row's disallowed tokens go
   to -inf (the sampler keeps logprobs under the raw logits).
4. ``Matcher.accept(token)`` for each token the engine emits; once ``complete`` the
   grammar admits nothing more and the request ends (finish reason stop).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import llguidance
import torch

from engine.errors import InvalidRequestError
from engine.grammar_text import check
from engine.structured import StructuredOutput
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.sequence import Sequence

MAX_CACHED = 128  # compiled grammars kept per engine
_BITS = torch.arange(32, dtype=torch.int32)


def lltokenizer(tokenizer: Tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of ``tokenizer``: every id's bytes (special tokens marked so no
    grammar can spell them), the model's ``vocab_size`` rows, its EOS ids as the end."""
    return llguidance.LLTokenizer(
        _Vocabulary(tokenizer, vocab_size),
        n_vocab=vocab_size,
        eos_token=sorted(tokenizer.eos_token_ids),
    )


class _Vocabulary(llguidance.TokenizerWrapper):
    """What ``LLTokenizer`` reads from a tokenizer (its ``__init__`` expects a
    transformers tokenizer, so it is not called)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        n = tokenizer.vocab_size
        special = [i for i in range(n) if tokenizer.is_special(i)]
        tokens = [tokenizer.token_bytes(i) for i in range(n)]
        for i in special:
            tokens[i] = b"\xff" + tokens[i]  # llguidance's mark for a special token
        self.tokens = tokens + [b""] * (vocab_size - n)  # the model's padding rows
        self.special_token_ids = special
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = None
        self.is_tokenizer_wrapper = True
        self._tokenizer = tokenizer
        self._accepts_bytes = False

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


class Matcher:
    """One sequence's place in its grammar. Owned by the sequence; advanced by the engine
    thread with each token the sequence emits."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False when the grammar does not allow it."""
        return self._m.consume_token(token_id)

    @property
    def complete(self) -> bool:
        """The grammar admits no further token (only the end)."""
        return self._m.is_stopped()

    @property
    def failed(self) -> bool:
        return self._m.is_error()

    @property
    def llmatcher(self) -> llguidance.LLMatcher:
        return self._m


class Grammars:
    """One engine's grammar compiler: its tokenizer's llguidance view (built on first use)
    and a bounded cache of compiled grammars, each a matcher at its start to copy."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()

    def matcher(self, structured: StructuredOutput, resumed: Seq[int] = ()) -> Matcher:
        """A fresh matcher for ``structured`` advanced by ``resumed`` (a migrated request's
        output so far). ``InvalidRequestError`` when the grammar does not compile, or a
        resumed token breaks it or had already completed it."""
        start = self._compiled.get(structured)
        if start is None:
            if self._lltokenizer is None:
                self._lltokenizer = lltokenizer(self._tokenizer, self.vocab_size)
            start = llguidance.LLMatcher(self._lltokenizer, check(structured))
            if start.is_error():
                raise InvalidRequestError(
                    f"structured output {structured.kind.value}: {start.get_error()}"
                )
            self._compiled[structured] = start
            if len(self._compiled) > MAX_CACHED:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(structured)
        m = Matcher(start.deep_copy())
        for i, token_id in enumerate(resumed):
            if not m.accept(token_id):
                raise InvalidRequestError(
                    f"resume_token_ids[{i}] ({token_id}) is not allowed by the structured output"
                )
        if resumed and m.complete:
            raise InvalidRequestError(
                "resume_token_ids already complete the structured output: there is nothing "
                "to resume"
            )
        return m


def mask(logits: torch.Tensor, seqs: Seq[Sequence]) -> torch.Tensor:
    """``logits`` (``[B, V]``, one row per sequence of ``seqs``) with each constrained row's
    disallowed tokens at -inf; ``logits`` itself when no row is constrained (it is never
    modified: the sampler reads the raw logits for logprobs)."""
    rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
    if not rows:
        return logits
    bitmask = torch.zeros((len(rows), (logits.shape[1] + 31) // 32), dtype=torch.int32)
    fill_bitmask([seqs[i].grammar.llmatcher for i in rows], bitmask)  # type: ignore[union-attr]
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0]:
        out = logits.clone()
        apply_bitmask(out, bitmask)
        return out
    index = torch.tensor(rows, device=logits.device)
    constrained = logits.index_select(0, index)
    apply_bitmask(constrained, bitmask)
    return logits.index_copy(0, index, constrained)


def fill_bitmask(matchers: Seq[llguidance.LLMatcher], bitmask: torch.Tensor) -> None:
    """Write each matcher's next-token mask into its row of ``bitmask`` (``[B, ceil(V / 32)]``
    int32, contiguous, on the CPU), one row after another on the calling thread.

    A row costs 0.01-0.03 ms (docs/benchmarks.md, "Structured outputs"), so llguidance's
    parallel executor buys nothing here; its pool threads, on the cores the worker is
    pinned to, would compete with the engine thread that waits for them. The call
    ``llguidance.torch`` wraps, made here: importing that module runs a ``torch.compile``
    decorator, which imports torch's compiler and triton into every process that serves a
    structured request (seconds at start, and triton where nothing else loads it)."""
    assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and bitmask.device.type == "cpu"
    row_bytes = bitmask.shape[1] * 4
    for r, matcher in enumerate(matchers):
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + r * row_bytes, row_bytes)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[r, t]`` to -inf, in place, where bit ``t`` of row ``r`` of ``bitmask``
    (``[B, ceil(V / 32)]`` int32, bit ``t % 32`` of word ``t // 32``) is clear."""
    bits = (bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1
    allowed = bits.reshape(bitmask.shape[0], -1)[:, : logits.shape[1]].bool()
    logits.masked_fill_(~allowed, -torch.inf)

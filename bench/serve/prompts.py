"""Prompts of an exact token length, each opened by a fresh random nonce.

A prompt is a sequence of whole words, each of which the tokenizer maps to exactly one
token with its leading space (``" parsley"`` -> ``Ġparsley``). Byte-level pre-tokenizers
split text at those spaces, so the text of the ids re-encodes to the same ids: the prompt
has the asked length whether it is sent as token ids or as text.

Servers cache prompt prefixes, so every prompt starts with ``NONCE_WORDS`` words drawn from
the operating system's randomness (not the seed): no two prompts, in one run or across runs,
share a first block. The rest of the prompt (the filler) comes from the seeded generator.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass

from engine.tokenizer import Tokenizer

NONCE_WORDS = 6
_WORD = re.compile(r"Ġ[a-z]{3,10}")  # Ġ is the byte-level spelling of a leading space
_MIN_POOL = 256


@dataclass(frozen=True)
class Prompt:
    """``ids``: the exact token ids the server evaluates (chat: the templated prompt).
    ``text``: what to send as text (completions: ``decode(ids)`` minus bos; chat: the user
    message's content)."""

    ids: tuple[int, ...]
    text: str


@functools.lru_cache(maxsize=4)
def single_token_words(tokenizer: Tokenizer) -> tuple[int, ...]:
    """Ids of lower-case vocabulary words (with a leading space) that encode to themselves.

    Cached per tokenizer (tokenizers are immutable): scanning a vocabulary is slow."""
    pool = []
    for i in range(tokenizer.vocab_size):
        if tokenizer.is_special(i) or not _WORD.fullmatch(tokenizer.id_to_token(i)):
            continue
        if tokenizer.encode(tokenizer.decode([i]), add_special_tokens=False) == [i]:
            pool.append(i)
    if len(pool) < _MIN_POOL:
        raise ValueError(
            f"the tokenizer has only {len(pool)} single-token words (need {_MIN_POOL}); "
            "exact-length prompts need a byte-level BPE vocabulary of English words"
        )
    return tuple(pool)


def bos_prefix(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The tokens a prompt opens with before its words: bos where the tokenizer adds one
    when it encodes text (as a server does), else none."""
    bos = tokenizer.bos_token_id
    return (bos,) if tokenizer.add_bos_token and bos is not None else ()


class PromptFactory:
    """Builds exact-length prompts for one tokenizer.

    ``chat=True``: the length counts the chat template the server applies around a single
    user message (``make(n).ids`` is the whole templated prompt, ``text`` the message).
    ``seed`` fixes the filler words; nonces are always fresh (``nonce_rng`` overrides that,
    for tests only).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        seed: int = 0,
        chat: bool = False,
        nonce_rng: random.Random | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self._words = single_token_words(tokenizer)
        self._filler = random.Random(seed)
        self._nonce = nonce_rng or random.SystemRandom()
        self._prefix = bos_prefix(tokenizer)
        self._overhead = len(self._template([])) if chat else len(self._prefix)

    @property
    def min_tokens(self) -> int:
        """The shortest prompt this factory can build (one word plus bos or template)."""
        return self._overhead + 1

    def make(self, n_tokens: int) -> Prompt:
        """A prompt of exactly ``n_tokens`` tokens; raises ``ValueError`` below ``min_tokens``."""
        if n_tokens < self.min_tokens:
            raise ValueError(f"a prompt needs at least {self.min_tokens} tokens, got {n_tokens}")
        n_words = n_tokens - self._overhead
        n_nonce = min(NONCE_WORDS, n_words)
        words = [self._nonce.choice(self._words) for _ in range(n_nonce)]
        words += [self._filler.choice(self._words) for _ in range(n_words - n_nonce)]
        text = self.tokenizer.decode(words)
        if not self.chat:
            return Prompt(ids=self._prefix + tuple(words), text=text)
        ids = self._template(words)
        if len(ids) != n_tokens:  # the template tokenized differently around the content
            raise ValueError(
                f"the chat template does not tokenize additively: {len(ids)} tokens for a "
                f"{n_tokens}-token prompt; use the completions endpoint"
            )
        return Prompt(ids=tuple(ids), text=text)

    def _template(self, words: list[int]) -> list[int]:
        tok = self.tokenizer
        rendered = tok.apply_chat_template([{"role": "user", "content": tok.decode(words)}])
        return tok.encode(rendered, add_special_tokens=False)

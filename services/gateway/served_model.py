"""A model as the gateway serves it: its public name, tokenizer and limits.

The gateway turns every request into prompt token ids itself (template, tokenize, check), so
each edge (HTTP, gRPC) shares these helpers and every backend receives ready ids. Errors are
``InvalidRequestError`` with a message a client can act on.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:  # the gateway itself must not need torch: only the local backend does
    from engine.llm_engine import LLMEngine


class ContextLengthError(InvalidRequestError):
    """The prompt, or the prompt plus ``max_tokens``, does not fit the model's context."""


def check_unicode(text: str, what: str) -> None:
    """Reject text that is not encodable as UTF-8 (JSON ``\\ud800`` escapes decode to lone
    surrogates, which the tokenizer cannot take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{what} is not valid Unicode: {exc.reason} at position {exc.start}"
        ) from None


@dataclass(frozen=True)
class ServedModel:
    """One served model. ``max_model_len`` is the most prompt + generated tokens per request."""

    name: str
    tokenizer: Tokenizer = field(repr=False)
    max_model_len: int
    vocab_size: int
    created: int = field(default_factory=lambda: int(time.time()))
    owned_by: str = "pdserve"
    # Every token stands for at most this many bytes, so a text longer than
    # max_model_len * this cannot fit, whatever it says: refused without tokenizing it.
    longest_token_bytes: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        tok = self.tokenizer
        longest = max(len(tok.token_bytes(i)) for i in range(tok.vocab_size))
        object.__setattr__(self, "longest_token_bytes", longest)

    @property
    def max_prompt_chars(self) -> int:
        """The longest prompt text (characters, after templating) that could still fit."""
        return self.max_model_len * self.longest_token_bytes

    def check_prompt_chars(self, chars: int, what: str = "prompt") -> None:
        """Refuse, before any templating or tokenizing, text of ``chars`` characters that
        cannot fit the context (a character is at least one byte of some token)."""
        if chars > self.max_prompt_chars:
            raise ContextLengthError(
                f"This model's maximum context length is {self.max_model_len} tokens, and no "
                f"token is longer than {self.longest_token_bytes} bytes, so a {what} of "
                f"{chars} characters cannot fit (at most {self.max_prompt_chars}). Please "
                f"reduce the length of the {what}."
            )

    @classmethod
    def for_engine(cls, name: str, engine: LLMEngine) -> ServedModel:
        """The model an in-process engine serves, with that engine's limits."""
        return cls(
            name=name,
            tokenizer=engine.tokenizer,
            max_model_len=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size,
        )

    def encode_text(self, text: str, what: str = "prompt") -> tuple[int, ...]:
        """Tokenize a raw prompt (BOS added when the tokenizer adds one)."""
        if not text:
            raise InvalidRequestError(f"{what} must not be empty")
        check_unicode(text, what)
        return tuple(self.tokenizer.encode(text))

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> tuple[int, ...]:
        """Apply the chat template (generation prompt added) and tokenize the result."""
        for i, message in enumerate(messages):
            for key, value in message.items():
                check_unicode(value, f"messages[{i}].{key}")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # The template writes BOS itself where the model expects one.
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def check_token_ids(self, ids: Sequence[int], what: str = "prompt") -> tuple[int, ...]:
        """Validate pre-tokenized input: non-empty, every id an integer in [0, vocab_size)."""
        if not ids:
            raise InvalidRequestError(f"{what} must contain at least one token id")
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise InvalidRequestError(
                    f"{what}[{i}]={t!r} is not a token id: ids must be integers in "
                    f"[0, {self.vocab_size})"
                )
        return tuple(ids)

    def check_request(self, params: SamplingParams, prompt_len: int) -> None:
        """Check that ``params`` can apply to a prompt of ``prompt_len`` tokens.

        Raises ``ContextLengthError`` when the prompt leaves no room to generate, or when
        prompt plus ``max_tokens`` overflows the context; ``InvalidRequestError`` (naming the
        field) for ``max_tokens`` above the context length or a stop token id outside the
        vocabulary.
        """
        limit = self.max_model_len
        if prompt_len >= limit or prompt_len + params.max_tokens > limit >= params.max_tokens:
            raise ContextLengthError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_len + params.max_tokens} tokens ({prompt_len} in the "
                f"prompt, {params.max_tokens} for the completion). Please reduce the length "
                "of the prompt or of max_tokens."
            )
        params.check_against(prompt_len=prompt_len, max_model_len=limit, vocab_size=self.vocab_size)

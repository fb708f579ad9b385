"""Per-request sampling parameters, validated once when the request arrives."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.errors import InvalidRequestError

MAX_STOP_STRINGS = 16
_MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed accepts up to an unsigned 64-bit value


def _is_int(value: object) -> bool:
    # bool is an int subclass; True as max_tokens is a caller mistake, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _bad(field: str, value: object, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{field}={value!r} is invalid: {why}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each generated token for one request, and when to stop.

    Construction validates every field and raises ``InvalidRequestError`` naming the field
    and its bad value. ``stop`` and ``stop_token_ids`` accept lists (a lone ``str`` counts as
    one stop string) and are stored as tuples so the object stays hashable.

    ``temperature == 0`` means greedy (argmax); ``top_k`` of 0 or -1 disables top-k;
    ``top_p == 1`` disables nucleus filtering; ``min_p == 0`` disables min-p. Stop strings are
    cut from the output; ``stop_token_ids`` end the request like EOS does.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise _bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if (
            not _is_number(self.temperature)
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise _bad("temperature", self.temperature, "must be a finite number >= 0")
        object.__setattr__(self, "temperature", float(self.temperature))
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _bad("top_k", self.top_k, "must be an integer >= -1 (0 or -1 disables it)")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            # nan fails the chained comparison, so it lands here too.
            raise _bad("top_p", self.top_p, "must be a number in (0, 1]")
        object.__setattr__(self, "top_p", float(self.top_p))
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", self.min_p, "must be a number in [0, 1]")
        object.__setattr__(self, "min_p", float(self.min_p))
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _MAX_SEED):
            raise _bad("seed", self.seed, f"must be null or an integer in [0, {_MAX_SEED}]")
        object.__setattr__(self, "stop", self._normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", self._normalise_stop_ids(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "must be a boolean")
        if not isinstance(self.logprobs, bool):
            raise _bad("logprobs", self.logprobs, "must be a boolean")

    @staticmethod
    def _normalise_stop(stop: object) -> tuple[str, ...]:
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, Sequence):
            raise _bad("stop", stop, "must be a string or a list of strings")
        if len(stop) > MAX_STOP_STRINGS:
            raise _bad("stop", stop, f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        for entry in stop:
            if not isinstance(entry, str) or not entry:
                raise _bad("stop", stop, f"entry {entry!r} is not a non-empty string")
        return tuple(stop)

    @staticmethod
    def _normalise_stop_ids(ids: object) -> tuple[int, ...]:
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
            raise _bad("stop_token_ids", ids, "must be a list of integers")
        for entry in ids:
            if not _is_int(entry) or entry < 0:
                raise _bad("stop_token_ids", ids, f"entry {entry!r} is not an integer >= 0")
        return tuple(ids)

    @property
    def greedy(self) -> bool:
        """True when tokens are picked by argmax (temperature 0); filters are then moot."""
        return self.temperature == 0.0

    def check_against(self, *, prompt_len: int, max_model_len: int, vocab_size: int) -> None:
        """Raise ``InvalidRequestError`` if these parameters cannot apply to this prompt/model.

        Rejects an empty prompt, ``max_tokens`` above the context length, a prompt plus
        ``max_tokens`` that overflows the context, and stop token ids outside the vocabulary.
        """
        if prompt_len <= 0:
            raise InvalidRequestError(f"prompt_len={prompt_len}: the prompt must not be empty")
        if self.max_tokens > max_model_len:
            raise _bad("max_tokens", self.max_tokens, f"exceeds max_model_len={max_model_len}")
        if prompt_len + self.max_tokens > max_model_len:
            raise InvalidRequestError(
                f"prompt_len={prompt_len} + max_tokens={self.max_tokens} = "
                f"{prompt_len + self.max_tokens} exceeds max_model_len={max_model_len}"
            )
        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                raise _bad(
                    "stop_token_ids",
                    self.stop_token_ids,
                    f"id {token_id} is outside the vocabulary (vocab_size={vocab_size})",
                )

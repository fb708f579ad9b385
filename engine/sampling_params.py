"""Per-request sampling parameters, validated once when the request arrives."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.structured import StructuredOutput

MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
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

    What changes the logits before any of that (``engine.penalties``, in this order):
    ``min_tokens`` (EOS and ``stop_token_ids`` are barred until that many tokens are out),
    ``logit_bias`` (``(token id, bias)`` pairs, added), ``repetition_penalty`` (a token in
    the prompt or the output so far: a positive logit divided by it, a negative one
    multiplied; 1 disables it), ``frequency_penalty`` and ``presence_penalty`` (subtracted
    per occurrence in the output so far, and once if it occurs at all; 0 disables them).
    A dict given as ``logit_bias`` is stored as sorted pairs.

    ``structured``: a constraint the whole output must meet (``engine.structured``), or None.

    ``logprobs``: return each sampled token's log-probability under the model's raw
    distribution; ``top_logprobs`` (0 to 20, needs ``logprobs``): also that many most likely
    tokens at each step and theirs. ``include_stop_str_in_output``: a matched stop string
    stays at the end of the text instead of being cut.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    structured: StructuredOutput | None = None
    top_logprobs: int = 0
    include_stop_str_in_output: bool = False

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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise _bad(name, value, "must be a number in [-2, 2]")
            object.__setattr__(self, name, float(value))
        rep = self.repetition_penalty
        if not _is_number(rep) or not math.isfinite(rep) or rep <= 0:
            raise _bad("repetition_penalty", rep, "must be a finite number > 0 (1 disables it)")
        object.__setattr__(self, "repetition_penalty", float(rep))
        object.__setattr__(self, "logit_bias", self._normalise_bias(self.logit_bias))
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, "must be an integer in [0, max_tokens]")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise _bad("structured", self.structured, "must be a StructuredOutput or None")
        top = self.top_logprobs
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise _bad("top_logprobs", top, f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        if top and not self.logprobs:
            raise _bad("top_logprobs", top, "needs logprobs=True")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise _bad(
                "include_stop_str_in_output", self.include_stop_str_in_output, "must be a boolean"
            )

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

    @staticmethod
    def _normalise_bias(bias: object) -> tuple[tuple[int, float], ...]:
        items = bias.items() if isinstance(bias, Mapping) else bias
        if isinstance(items, str | bytes) or not isinstance(items, Iterable):
            raise _bad("logit_bias", bias, "must map token ids to numbers")
        pairs = list(items)
        if len(pairs) > MAX_LOGIT_BIAS:
            raise _bad("logit_bias", f"{len(pairs)} entries", f"at most {MAX_LOGIT_BIAS}")
        out: dict[int, float] = {}
        for pair in pairs:
            if not isinstance(pair, Sequence) or len(pair) != 2:
                raise _bad("logit_bias", bias, f"entry {pair!r} is not a (token id, bias) pair")
            token, value = pair
            if not _is_int(token) or token < 0:
                raise _bad("logit_bias", bias, f"token id {token!r} is not an integer >= 0")
            if not _is_number(value) or not -100.0 <= value <= 100.0:
                raise _bad("logit_bias", bias, f"bias {value!r} is not a number in [-100, 100]")
            out[token] = float(value)
        return tuple(sorted(out.items()))

    @property
    def changes_logits(self) -> bool:
        """Whether a penalty, a bias or ``min_tokens`` applies (``engine.penalties``)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def greedy(self) -> bool:
        """True when tokens are picked by argmax (temperature 0); filters are then moot."""
        return self.temperature == 0.0

    def check_against(self, *, prompt_len: int, max_model_len: int, vocab_size: int) -> None:
        """Raise ``InvalidRequestError`` if these parameters cannot apply to this prompt/model.

        Rejects an empty prompt, ``max_tokens`` above the context length, a prompt plus
        ``max_tokens`` that overflows the context, and stop token ids or ``logit_bias`` ids
        outside the vocabulary.
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
        for token_id, _ in self.logit_bias:
            if token_id >= vocab_size:
                raise _bad(
                    "logit_bias",
                    dict(self.logit_bias),
                    f"token id {token_id} is outside the vocabulary (vocab_size={vocab_size})",
                )

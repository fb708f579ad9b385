"""From sampled tokens to what a client sees: text deltas, stop conditions, finish reasons.

Owns one incremental detokenizer and stop-string checker per request. Pure bookkeeping over
token ids: the engine calls ``process`` once per sampled token and finishes the sequence
when it returns a finish reason.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason
from engine.stop_checker import StopChecker
from engine.tokenizer import Tokenizer
from engine.top_logprobs import TopLogprobs


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request (a streaming event).

    ``new_top_logprobs``: one entry per new token when the request asks for top logprobs
    (``SamplingParams.top_logprobs``), else empty."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[float, ...]
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    new_top_logprobs: tuple[TopLogprobs, ...] = ()


@dataclass
class _Stream:
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    stop: StopChecker | None
    num_output: int = 0
    text: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos = eos_token_ids
        self._streams: dict[str, _Stream] = {}

    def add(self, request_id: str, params: SamplingParams, resumed: Seq[int] = ()) -> None:
        """Open a request's stream. ``resumed``: output tokens a previous worker already
        produced and the client received (a migrated request); they are replayed here, their
        text discarded, so the detokenizer, the stop-string checker and the max_tokens count
        stand exactly where the previous worker's did."""
        self._streams[request_id] = self._replayed(params, resumed)

    def check_resumable(self, params: SamplingParams, resumed: Seq[int]) -> None:
        """Raise ``InvalidRequestError`` if ``resumed`` tokens had already ended the request."""
        self._replayed(params, resumed)

    def _replayed(self, params: SamplingParams, resumed: Seq[int]) -> _Stream:
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        stop = (
            StopChecker(params.stop, include_stop=params.include_stop_str_in_output)
            if params.stop
            else None
        )
        s = _Stream(params, detok, stop)
        for i, token_id in enumerate(resumed):
            _, reason = self._account(s, token_id, room_left=1)
            if reason is not None:
                raise InvalidRequestError(
                    f"resume_token_ids[{i}] already ended the request ({reason.value}): "
                    "there is nothing to resume"
                )
        return s

    def remove(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def process(
        self, request_id: str, token_id: int, room_left: int, *, complete: bool = False
    ) -> tuple[str, FinishReason | None]:
        """Account one sampled token; return the text it releases and why it finishes, if so.

        ``room_left`` is how many more tokens fit in the context after this one.
        ``complete``: the token completed the request's structured output (its grammar
        admits nothing more), which ends it like a stop.
        """
        return self._account(self._streams[request_id], token_id, room_left, complete)

    def _account(
        self, s: _Stream, token_id: int, room_left: int, complete: bool = False
    ) -> tuple[str, FinishReason | None]:
        s.num_output += 1
        p = s.params
        # An EOS that completes a grammar ends the output even under ignore_eos.
        is_eos = token_id in self.eos and (complete or not p.ignore_eos)
        if is_eos or token_id in p.stop_token_ids:
            # The stop token itself is not part of the text.
            return self._flush(s), FinishReason.STOP
        delta = s.detok.add(token_id) if s.detok is not None else ""
        if s.stop is not None:
            delta, stopped = s.stop.feed(delta)
            if stopped:
                return delta, FinishReason.STOP
        if complete:
            return delta + self._flush(s), FinishReason.STOP
        if s.num_output >= p.max_tokens or room_left <= 0:
            return delta + self._flush(s), FinishReason.LENGTH
        return delta, None

    def _flush(self, s: _Stream) -> str:
        tail = s.detok.flush() if s.detok is not None else ""
        if s.stop is not None:
            tail, stopped = s.stop.feed(tail) if tail else ("", False)
            if not stopped:
                tail += s.stop.flush()
        return tail

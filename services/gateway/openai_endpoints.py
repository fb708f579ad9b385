"""The two generation endpoints as the few pieces in which they differ.

``/v1/completions`` and ``/v1/chat/completions`` share one request path
(``http_server._generate``). An ``Endpoint`` names what is its own: how a body is parsed
and prepared (``openai_api``), its ids' prefix, the request field a prompt error names, and
its ``Shape``: how one request's answer looks, whole (``whole``, from every choice's
``Result``) or streamed (``intro`` frames before the first chunk, then each chunk's
``frames``, then ``usage_frame`` when ``stream_options.include_usage`` asks for it).

A shape is made once per request, after its prompt is prepared, and keeps whatever a stream
needs across chunks: completions the echoed prompt and each choice's text offset (for
``logprobs.text_offset``), chat each choice's tool-call reader.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from engine.tokenizer import Tokenizer
from engine.top_logprobs import TopLogprobs
from services.gateway import openai_responses as out
from services.gateway import tools
from services.gateway.backend import GenerateChunk, GenerateInput, ServedBy
from services.gateway.openai_api import (
    ChatRequest,
    CompletionRequest,
    Limits,
    echo_text,
    parse_chat,
    parse_completion,
    prepare_chat,
    prepare_completion,
)
from services.gateway.served_model import ServedModel

R = TypeVar("R", CompletionRequest, ChatRequest)
Frame = dict[str, Any]


class _Tokens(Protocol):
    """Tokens with their log-probabilities: a chunk's, or a whole choice's."""

    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def logprobs(self) -> Sequence[float]: ...
    @property
    def top_logprobs(self) -> Sequence[TopLogprobs]: ...


@dataclass
class Result:
    """One choice's whole generation, for a whole response."""

    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)


@dataclass
class Results:
    """Every choice of a whole response: results by index, and the last chunk of each."""

    choices: list[Result]
    last: dict[int, GenerateChunk] = field(default_factory=dict)

    @classmethod
    def of(cls, n: int) -> Results:
        return cls([Result() for _ in range(n)])

    def add(self, index: int, chunk: GenerateChunk) -> None:
        r = self.choices[index]
        r.parts.append(chunk.text_delta)
        r.token_ids.extend(chunk.token_ids)
        r.logprobs.extend(chunk.logprobs)
        r.top_logprobs.extend(chunk.top_logprobs)
        r.finish_reason = chunk.finish_reason
        self.last[index] = chunk

    @property
    def usage(self) -> dict[str, Any]:
        return _usage(self.last)

    @property
    def extension(self) -> dict[str, Any]:
        return _extension(self.last)


def _usage(last: dict[int, GenerateChunk]) -> dict[str, Any]:
    """One request's usage over its choices: the prompt counted once (choice 0's cached
    tokens), every choice's completion tokens."""
    first = last[min(last)]
    completion = sum(c.completion_tokens for c in last.values())
    return out.usage(first.prompt_tokens, completion, first.cached_tokens)


def _extension(last: dict[int, GenerateChunk]) -> dict[str, Any]:
    """The ``"pdserve"`` object: who served choice 0."""
    return out.extension(last[0].served_by if 0 in last else ServedBy())


@dataclass(frozen=True)
class Reply(Generic[R]):
    """What every object of one request's answer carries or is built from."""

    id: str
    created: int  # Unix seconds
    model: ServedModel
    inp: GenerateInput
    req: R


class Shape(ABC, Generic[R]):
    """How one request's answer looks (module docstring)."""

    chunk_object: ClassVar[str]  # the "object" of the stream's chunks

    def __init__(self, reply: Reply[R]) -> None:
        self.reply = reply

    @abstractmethod
    def whole(self, results: Results) -> Frame:
        """The whole response."""

    def logprobs(self, t: _Tokens, text_offset: int = 0) -> dict[str, Any] | None:
        """``t``'s logprobs object (``text_offset``: the length of the choice's text before
        ``t``'s), or None when the request did not ask for logprobs."""
        if not self.reply.inp.params.logprobs:
            return None
        return self._logprobs(self.reply.model.tokenizer, t, text_offset)

    @abstractmethod
    def _logprobs(self, tok: Tokenizer, t: _Tokens, text_offset: int) -> dict[str, Any]: ...

    def intro(self) -> list[Frame]:
        """The stream's frames before the first chunk's."""
        return []

    @abstractmethod
    def frames(self, index: int, chunk: GenerateChunk) -> list[Frame]:
        """The stream's frames for choice ``index``'s ``chunk`` (maybe none)."""

    def usage_frame(self, last: dict[int, GenerateChunk]) -> Frame | None:
        """The stream's usage chunk (``last``: each choice's last chunk), if asked for."""
        if not self.reply.req.include_usage:
            return None
        r = self.reply
        return out.usage_chunk(
            r.id, r.created, r.model.name, self.chunk_object, _usage(last), _extension(last)
        )


class CompletionShape(Shape[CompletionRequest]):
    """``text_completion`` objects; ``echo`` puts the prompt before each choice's text."""

    chunk_object = "text_completion"

    def __init__(self, reply: Reply[CompletionRequest]) -> None:
        super().__init__(reply)
        self.echo = echo_text(reply.req, reply.model)
        n = reply.req.n
        self.echoes = [self.echo] * n  # each choice's first frame leads with the echo
        self.offsets = [0] * n  # text sent so far per choice

    def _logprobs(self, tok: Tokenizer, t: _Tokens, text_offset: int) -> dict[str, Any]:
        return out.completion_logprobs(tok, t.token_ids, t.logprobs, text_offset, t.top_logprobs)

    def whole(self, results: Results) -> Frame:
        choices = [
            out.completion_choice(
                i, self.echo + c.text, c.finish_reason, self.logprobs(c, len(self.echo))
            )
            for i, c in enumerate(results.choices)
        ]
        r = self.reply
        return out.completion(
            r.id, r.created, r.model.name, choices, results.usage, results.extension
        )

    def frames(self, index: int, chunk: GenerateChunk) -> list[Frame]:
        text, self.echoes[index] = self.echoes[index] + chunk.text_delta, ""
        lp = self.logprobs(chunk, self.offsets[index] + len(text) - len(chunk.text_delta))
        self.offsets[index] += len(text)
        if not text and chunk.finish_reason is None and lp is None:
            return []
        choice = out.completion_choice(index, text, chunk.finish_reason, lp)
        return [out.completion(self.reply.id, self.reply.created, self.reply.model.name, [choice])]


class ChatShape(Shape[ChatRequest]):
    """``chat.completion`` and its chunks; with tools, the assistant's text is read for
    tool calls (``tools``), whole or as it streams."""

    chunk_object = "chat.completion.chunk"

    def __init__(self, reply: Reply[ChatRequest]) -> None:
        super().__init__(reply)
        spec = reply.req.tools
        self.readers = [tools.ToolStream(spec) for _ in range(reply.req.n)] if spec else []

    def _logprobs(self, tok: Tokenizer, t: _Tokens, text_offset: int) -> dict[str, Any]:
        return out.chat_logprobs(tok, t.token_ids, t.logprobs, t.top_logprobs)

    def _chunk(
        self,
        index: int,
        delta: dict[str, Any],
        finish: str | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> Frame:
        r = self.reply
        return out.chat_chunk(r.id, r.created, r.model.name, delta, finish, logprobs, index)

    def whole(self, results: Results) -> Frame:
        spec = self.reply.req.tools
        choices = [
            out.chat_choice(i, *_assistant_message(spec, c.text, c.finish_reason), self.logprobs(c))
            for i, c in enumerate(results.choices)
        ]
        r = self.reply
        return out.chat_completion(
            r.id, r.created, r.model.name, choices, results.usage, results.extension
        )

    def intro(self) -> list[Frame]:
        role = {"role": "assistant", "content": ""}
        return [self._chunk(i, role) for i in range(self.reply.req.n)]

    def frames(self, index: int, chunk: GenerateChunk) -> list[Frame]:
        lp = self.logprobs(chunk)
        deltas, finish = self._deltas(index, chunk, lp is not None)
        result = [self._chunk(index, d, None, lp if j == 0 else None) for j, d in enumerate(deltas)]
        if finish is not None:
            result.append(self._chunk(index, {}, finish))
        return result

    def _deltas(
        self, index: int, chunk: GenerateChunk, with_logprobs: bool
    ) -> tuple[list[dict[str, Any]], str | None]:
        """A chunk's deltas (one at least when it carries logprobs) and finish reason."""
        spec, finish = self.reply.req.tools, chunk.finish_reason
        if spec is None:
            text = chunk.text_delta
            return ([{"content": text}] if text or with_logprobs else []), finish
        reader = self.readers[index]
        events = reader.feed(chunk.text_delta) if chunk.text_delta else []
        if finish is not None:
            events += reader.finish()
            finish = _finish_reason(spec, reader.calls, finish)
        deltas = [tools.delta_for(e) for e in events]
        if with_logprobs and not deltas:
            deltas = [{}]
        return deltas, finish


def _assistant_message(
    spec: tools.ToolSpec | None, text: str, finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """A whole choice's assistant message (its ``tool_calls`` parsed out when the request
    has tools) and its finish reason."""
    if spec is None:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = tools.read_whole(spec, text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
    return message, _finish_reason(spec, calls, finish_reason)


def _finish_reason(
    spec: tools.ToolSpec, calls: Sequence[tools.ToolCall], finish_reason: str | None
) -> str | None:
    """``stop`` becomes ``tool_calls`` when the turn called tools (OpenAI's convention)."""
    if calls and finish_reason == "stop":
        return spec.finish_reason_for_calls
    return finish_reason


@dataclass(frozen=True)
class Endpoint(Generic[R]):
    """One generation endpoint's own pieces (module docstring)."""

    id_prefix: str  # of the ids of its responses: "cmpl-..."
    prompt_param: str  # the request field a prompt error names
    started_event: str  # the log line once the first chunk is out
    parse: Callable[[object, Collection[str]], R]
    prepare: Callable[[R, ServedModel, str, Limits], GenerateInput]
    shape: Callable[[Reply[R]], Shape[R]]


COMPLETIONS = Endpoint(
    "cmpl", "prompt", "completion_started", parse_completion, prepare_completion, CompletionShape
)
CHAT_COMPLETIONS = Endpoint(
    "chatcmpl", "messages", "chat_completion_started", parse_chat, prepare_chat, ChatShape
)

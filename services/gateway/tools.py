"""Tool calling for chat requests: what the model is told, what it may write, what we parse.

The default model's chat template has no tools section, so tools are rendered into the
system turn (``ToolSpec.system_text``), in this format: the tools as JSON lines between
``<tools>`` and ``</tools>``, then how to call one. What the model writes, by ``tool_choice``:

- ``none``: tools are left out of the prompt; the answer is text.
- ``auto``: free text, in which each call is ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`` (or a JSON list of such objects inside one pair of tags); calls of a
  known tool with object arguments become ``tool_calls``, anything else stays text. Nothing
  constrains the output: a model may answer or call. (The default SmolLM2-135M answers in
  text under ``auto``: it is too small to choose a call by itself; ``required`` and a named
  function make it call.)
- ``required``: the output is constrained (``SamplingParams.structured``, a JSON Schema) to
  a JSON array of ``{"name", "arguments"}`` objects, each naming a tool and matching its
  parameters' schema (one only when ``parallel_tool_calls`` is false).
- a named function: the output is constrained to that function's parameters' schema, and
  is its arguments.

A conversation's history renders back the same way: an assistant turn's ``tool_calls`` as
its ``<tool_call>`` lines, a ``tool`` message as a ``tool`` turn holding the result (the
ChatML template writes any role; of the forms tried, a ``tool`` turn is the one after which
SmolLM2-135M answers from the result instead of repeating it).

``ToolStream`` turns a choice's streamed text into content and tool-call events as OpenAI
streams them: a call's id and name first, then its arguments (all at once for ``auto`` and
``required``, whose calls are parsed whole; token by token for a named function).
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.structured import StructuredKind, StructuredOutput

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A tools field is invalid; ``param`` names it (the HTTP edge answers 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class Mode(enum.StrEnum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters_json: str  # the parameters' JSON Schema, as compact JSON text

    @property
    def parameters(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.parameters_json)
        return value


@dataclass(frozen=True)
class ToolCall:
    """One call the model made; ``arguments`` is JSON text, as OpenAI returns it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools and how it wants them used."""

    tools: tuple[Tool, ...]
    mode: Mode
    named: str | None = None  # the function ``tool_choice`` names (mode NAMED)
    parallel: bool = True

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)

    def system_text(self) -> str:
        """What the system turn says about the tools (empty for ``none``)."""
        if self.mode is Mode.NONE:
            return ""
        lines = [json.dumps(_tool_line(t), ensure_ascii=False) for t in self.tools]
        if self.mode is Mode.NAMED:
            how = (
                f"Call the function {self.named}: reply with nothing but its arguments, one "
                "JSON object matching its parameters."
            )
        elif self.mode is Mode.REQUIRED:
            how = (
                "Reply with nothing but a JSON array of calls, each "
                '{"name": <function name>, "arguments": <JSON object of its parameters>}.'
            )
        else:
            how = (
                "To call a function, write the call as "
                f'{CALL_OPEN}{{"name": <function name>, "arguments": <JSON object of its '
                f"parameters>}}{CALL_CLOSE}, one such line per call; otherwise answer "
                "directly."
            )
        if not self.parallel and self.mode is not Mode.NAMED:
            how += " Make at most one call."
        return "You can call these functions:\n<tools>\n" + "\n".join(lines) + "\n</tools>\n" + how

    def constraint(self) -> StructuredOutput | None:
        """The structured output that ``required`` and a named function impose."""
        if self.mode is Mode.NAMED:
            tool = self.tool(self.named or "")
            assert tool is not None
            return StructuredOutput(StructuredKind.JSON_SCHEMA, tool.parameters_json)
        if self.mode is not Mode.REQUIRED:
            return None
        call_schemas = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {
            "type": "array",
            "items": call_schemas[0] if len(call_schemas) == 1 else {"anyOf": call_schemas},
            "minItems": 1,
        }
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(schema))

    @property
    def finish_reason_for_calls(self) -> str:
        """OpenAI ends a turn that called tools with ``tool_calls``, except when the
        request forced a named function (``stop``)."""
        return "stop" if self.mode is Mode.NAMED else "tool_calls"


def _tool_line(t: Tool) -> dict[str, Any]:
    line: dict[str, Any] = {"name": t.name}
    if t.description:
        line["description"] = t.description
    line["parameters"] = t.parameters
    return line


# -- parsing the request ---------------------------------------------------------------------


def parse_tools(tools: object, tool_choice: object, parallel: object) -> ToolSpec | None:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``; None when it
    has no tools (then ``tool_choice`` may only be ``none``). Raises ``ToolError``."""
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise ToolError("'parallel_tool_calls' must be a boolean.", "parallel_tool_calls")
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise ToolError("'tool_choice' needs 'tools'.", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ToolError("'tools' must be an array.", "tools")
    if len(tools) > MAX_TOOLS:
        raise ToolError(f"'tools' has {len(tools)} entries, at most {MAX_TOOLS}.", "tools")
    parsed = tuple(_tool(i, t) for i, t in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise ToolError("'tools' names a function twice.", "tools")
    mode, named = _choice(tool_choice, set(names))
    return ToolSpec(parsed, mode, named, parallel)


def _tool(i: int, t: object) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type") != "function":
        raise ToolError(f"{where} must be an object with type 'function'.", f"{where}.type")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise ToolError(f"{where}.function must be an object.", f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolError(
            f"{where}.function.name must be 1-64 letters, digits, '_' or '-'; got {name!r}.",
            f"{where}.function.name",
        )
    description = fn.get("description", "")
    if not isinstance(description, str):
        raise ToolError(f"{where}.function.description must be a string.", f"{where}.function")
    params = fn.get("parameters", _EMPTY_PARAMETERS)
    if not isinstance(params, dict):
        raise ToolError(
            f"{where}.function.parameters must be a JSON Schema object.",
            f"{where}.function.parameters",
        )
    return Tool(name, description, json.dumps(params, separators=(",", ":")))


def _choice(choice: object, names: set[str]) -> tuple[Mode, str | None]:
    if choice is None:
        return Mode.AUTO, None
    if isinstance(choice, str):
        try:
            mode = Mode(choice)
        except ValueError:
            mode = None
        if mode is None or mode is Mode.NAMED:
            raise ToolError(
                f"'tool_choice' {choice!r} is invalid: 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}.',
                "tool_choice",
            )
        return mode, None
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise ToolError(
                f"'tool_choice' names the function {name!r}, which is not in 'tools'.",
                "tool_choice",
            )
        return Mode.NAMED, str(name)
    raise ToolError("'tool_choice' must be a string or a function object.", "tool_choice")


def parse_history_calls(index: int, calls: object) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls`` (history). Raises ``ToolError``."""
    where = f"messages[{index}].tool_calls"
    if calls is None:
        return ()
    if not isinstance(calls, list):
        raise ToolError(f"{where} must be an array.", where)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolError(f"{where}[{j}] must have a function with a name.", f"{where}[{j}]")
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise ToolError(f"{where}[{j}].function.arguments must be a string.", where)
        call_id = c.get("id", "")
        if not isinstance(call_id, str):
            raise ToolError(f"{where}[{j}].id must be a string.", f"{where}[{j}].id")
        out.append(ToolCall(call_id, fn["name"], arguments))
    return tuple(out)


# -- rendering the conversation --------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    """One message as the gateway read it (``openai_api.ChatMessage``'s fields)."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""


def render(turns: Sequence[Turn], spec: ToolSpec | None) -> list[dict[str, str]]:
    """The messages the chat template gets: the tools in the system turn (the request's
    own system message first, or a new one), assistant calls as ``<tool_call>`` lines, and
    a ``tool`` message as a turn of the ``tool`` role holding the result as sent."""
    out: list[dict[str, str]] = []
    for turn in turns:
        content = turn.content
        if turn.tool_calls:
            lines = [_call_text(c) for c in turn.tool_calls]
            content = "\n".join(([content] if content else []) + lines)
        out.append({"role": turn.role, "content": content})
    tools_text = spec.system_text() if spec is not None else ""
    if tools_text:
        if out and out[0]["role"] == "system":
            out[0]["content"] = out[0]["content"] + "\n\n" + tools_text
        else:
            out.insert(0, {"role": "system", "content": tools_text})
    return out


def _call_text(call: ToolCall) -> str:
    try:
        arguments: Any = json.loads(call.arguments)
    except ValueError:
        arguments = call.arguments
    body = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}{body}{CALL_CLOSE}"


# -- reading the output ----------------------------------------------------------------------


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    call: ToolCall  # ``arguments`` holds what is known now ("" when it streams after)


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str


Event = Content | CallStart | CallArguments


@dataclass
class ToolStream:
    """One choice's output, read as it streams (``feed`` each text delta, then ``finish``)."""

    spec: ToolSpec
    calls: list[ToolCall] = field(default_factory=list)
    _buffer: str = ""
    _named_args: list[str] = field(default_factory=list)

    def feed(self, delta: str) -> list[Event]:
        if self.spec.mode is Mode.NAMED:
            return self._feed_named(delta)
        self._buffer += delta
        if self.spec.mode is Mode.REQUIRED:
            return self._take_array_calls()
        return self._take_tagged(final=False)

    def finish(self) -> list[Event]:
        """The events the rest of the text gives once the output has ended."""
        if self.spec.mode is Mode.NAMED:
            if not self.calls:  # nothing was generated: an empty call still names it
                return self._feed_named("")
            return []
        if self.spec.mode is Mode.REQUIRED:
            events = self._take_array_calls()
            rest, self._buffer = self._buffer.strip(" \n\t,]"), ""
            return events + ([Content(rest)] if rest else [])
        return self._take_tagged(final=True)

    @property
    def content_only(self) -> bool:
        return not self.calls

    def _feed_named(self, delta: str) -> list[Event]:
        events: list[Event] = []
        if not self.calls:
            call = ToolCall(new_call_id(), self.spec.named or "", "")
            self.calls.append(call)
            events.append(CallStart(0, call))
        if delta:
            self._named_args.append(delta)
            self.calls[0] = ToolCall(
                self.calls[0].id, self.calls[0].name, "".join(self._named_args)
            )
            events.append(CallArguments(0, delta))
        return events

    def _take_array_calls(self) -> list[Event]:
        """Every complete ``{"name", "arguments"}`` object at the front of the array."""
        events: list[Event] = []
        decoder = json.JSONDecoder()
        while True:
            text = self._buffer.lstrip(" \n\t[,")
            if not text.startswith("{"):
                self._buffer = text
                return events
            try:
                obj, end = decoder.raw_decode(text)
            except ValueError:
                self._buffer = text
                return events  # the object is not complete yet
            self._buffer = text[end:]
            events += self._call_events(obj)

    def _take_tagged(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while self._buffer:
            start = self._buffer.find(CALL_OPEN)
            if start < 0:
                keep = 0 if final else _partial_tag(self._buffer)
                text = self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep :]
                if text:
                    events.append(Content(text))
                return events
            if start:
                events.append(Content(self._buffer[:start]))
                self._buffer = self._buffer[start:]
            end = self._buffer.find(CALL_CLOSE)
            if end < 0 and not final:
                return events  # inside a call: wait for its end
            body = self._buffer[len(CALL_OPEN) : end if end >= 0 else None]
            raw = self._buffer[: end + len(CALL_CLOSE)] if end >= 0 else self._buffer
            self._buffer = self._buffer[len(raw) :]
            parsed = _json_object(body)
            # One call, or a list of them (the form SmolLM2 was tuned on).
            items = parsed if isinstance(parsed, list) else [parsed]
            call_events = [e for item in items for e in self._call_events(item)]
            events += call_events or [Content(raw)]
        return events

    def _call_events(self, obj: object) -> list[Event]:
        """A parsed call object's events; none when it is not a call of a known tool (or
        one call is already made and parallel calls are off)."""
        if not isinstance(obj, dict):
            return []
        name = obj.get("name")
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(name, str) or self.spec.tool(name) is None:
            return []
        if not isinstance(arguments, dict):
            return []
        if self.calls and not self.spec.parallel:
            return []
        call = ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))
        index = len(self.calls)
        self.calls.append(call)
        return [
            CallStart(index, ToolCall(call.id, name, "")),
            CallArguments(index, call.arguments),
        ]


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of ``text`` that could begin ``<tool_call>``."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def _json_object(text: str) -> object | None:
    try:
        return json.loads(text.strip())
    except ValueError:
        return None


def delta_for(event: Event) -> dict[str, Any]:
    """The ``chat.completion.chunk`` delta OpenAI sends for ``event``."""
    if isinstance(event, Content):
        return {"content": event.text}
    if isinstance(event, CallStart):
        return {
            "tool_calls": [
                {
                    "index": event.index,
                    "id": event.call.id,
                    "type": "function",
                    "function": {"name": event.call.name, "arguments": event.call.arguments},
                }
            ]
        }
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


def read_whole(spec: ToolSpec, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole output's content (None when it is only calls) and calls."""
    stream = ToolStream(spec)
    events = stream.feed(text) + stream.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    if stream.calls and not content.strip():
        return None, stream.calls
    return content, stream.calls

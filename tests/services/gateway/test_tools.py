"""Tool calling's pure parts: reading ``tools`` / ``tool_choice``, rendering tools and the
history into the prompt, the constraint each choice imposes, and reading calls out of a
streamed output however it is split."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.structured import StructuredKind
from services.gateway import tools
from services.gateway.openai_api import ApiError, parse_chat
from services.gateway.tools import (
    CallArguments,
    CallStart,
    Content,
    Mode,
    ToolCall,
    ToolError,
    ToolStream,
    Turn,
    parse_tools,
    read_whole,
    render,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _spec(choice: object = None, parallel: object = None) -> tools.ToolSpec:
    spec = parse_tools([WEATHER, TIME], choice, parallel)
    assert spec is not None
    return spec


@pytest.mark.parametrize(
    ("tools_", "choice", "parallel", "param", "needle"),
    [
        ({"x": 1}, None, None, "tools", "must be an array"),
        ([{"type": "code"}], None, None, "tools[0].type", "type 'function'"),
        ([{"type": "function", "function": {"name": "a b"}}], None, None,
         "tools[0].function.name", "1-64"),
        ([WEATHER, WEATHER], None, None, "tools", "twice"),
        ([{"type": "function", "function": {"name": "f", "parameters": 3}}], None, None,
         "tools[0].function.parameters", "JSON Schema"),
        ([WEATHER], "sometimes", None, "tool_choice", "'sometimes' is invalid"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, "tool_choice",
         "not in 'tools'"),
        (None, "required", None, "tool_choice", "needs 'tools'"),
        ([WEATHER], None, "yes", "parallel_tool_calls", "a boolean"),
    ],
)  # fmt: skip
def test_bad_tool_fields_name_the_parameter(tools_, choice, parallel, param, needle) -> None:
    with pytest.raises(ToolError) as err:
        parse_tools(tools_, choice, parallel)
    assert err.value.param == param
    assert needle in str(err.value)


def test_choices_default_to_auto_with_tools_and_none_without() -> None:
    assert parse_tools(None, None, None) is None
    assert parse_tools([], "none", None) is None
    assert _spec().mode is Mode.AUTO
    assert _spec("none").mode is Mode.NONE
    named = _spec({"type": "function", "function": {"name": "get_time"}})
    assert (named.mode, named.named) == (Mode.NAMED, "get_time")


def test_the_prompt_carries_the_tools_and_the_history_in_the_documented_format() -> None:
    spec = _spec()
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    turns = [
        Turn("system", "Be brief."),
        Turn("user", "Weather in Paris and the time?"),
        Turn("assistant", "", (call, ToolCall("call_2", "get_time", "{}"))),
        Turn("tool", '{"temp": 21}', tool_call_id="call_1"),
        Turn("tool", "12:00", tool_call_id="call_2"),
    ]
    msgs = render(turns, spec)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool"]
    system = msgs[0]["content"]
    assert system.startswith("Be brief.\n\nYou can call these functions:\n<tools>\n")
    lines = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line)["name"] for line in lines] == ["get_weather", "get_time"]
    assert tools.CALL_OPEN in system  # auto: how to write a call
    assert msgs[2]["content"] == (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    assert [m["content"] for m in msgs[3:]] == ['{"temp": 21}', "12:00"]
    assert render([Turn("user", "hi")], _spec("none")) == [{"role": "user", "content": "hi"}]
    assert render([Turn("user", "hi")], spec)[0]["role"] == "system"  # a new system turn


def test_required_and_named_constrain_to_the_calls_schema() -> None:
    required = _spec("required").constraint()
    assert required is not None and required.kind is StructuredKind.JSON_SCHEMA
    schema = json.loads(required.spec)
    ok = [
        {"name": "get_weather", "arguments": {"city": "Oslo"}},
        {"name": "get_time", "arguments": {}},
    ]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "arguments": {}}], [{"name": "x", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(_spec("required", parallel=False).constraint().spec)  # type: ignore[union-attr]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, single)
    named = _spec({"type": "function", "function": {"name": "get_weather"}}).constraint()
    assert named is not None
    assert json.loads(named.spec) == WEATHER["function"]["parameters"]  # type: ignore[index]
    assert _spec().constraint() is None and _spec("none").constraint() is None


def _events_split(spec: tools.ToolSpec, text: str, size: int) -> tuple[str, list[tuple]]:
    stream = ToolStream(spec)
    events = []
    for i in range(0, len(text), size):
        events += stream.feed(text[i : i + size])
    events += stream.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls = [(e.index, e.call.name) for e in events if isinstance(e, CallStart)]
    args: dict[int, str] = {}
    for e in events:
        if isinstance(e, CallArguments):
            args[e.index] = args.get(e.index, "") + e.text
    return content, [(i, n, json.loads(args[i])) for i, n in calls]


AUTO_OUT = (
    'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call> <b>done</b>'
)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_auto_output_gives_the_same_calls_however_it_streams(size: int) -> None:
    content, calls = _events_split(_spec(), AUTO_OUT, size)
    assert content == "Let me check. \n <b>done</b>"
    assert calls == [(0, "get_weather", {"city": "Oslo"}), (1, "get_time", {})]


def test_auto_leaves_what_is_not_a_known_call_as_text() -> None:
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call> and <tool_call>oops'
    content, calls = read_whole(_spec(), text)
    assert calls == [] and content == text
    content, calls = read_whole(_spec(), 'Sure.\n<tool_call>{"name": "get_time", "arguments": {}}')
    assert content == "Sure.\n" and [c.name for c in calls] == ["get_time"]  # unclosed at EOS
    _, calls = read_whole(_spec(parallel=False), AUTO_OUT)
    assert [c.name for c in calls] == ["get_weather"]
    listed = '<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "get_time"}]</tool_call>'
    assert [c.name for c in read_whole(_spec(), listed)[1]] == ["get_time", "get_time"]
    content, calls = read_whole(_spec(), "Just text.")
    assert (content, calls) == ("Just text.", [])


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_required_output_is_read_call_by_call(size: int) -> None:
    out = (
        '[{"name": "get_weather", "arguments": {"city": "Lima", "unit": "c"}}, '
        '{"name": "get_time", "arguments": {}}]'
    )
    content, calls = _events_split(_spec("required"), out, size)
    assert content == ""
    assert calls == [(0, "get_weather", {"city": "Lima", "unit": "c"}), (1, "get_time", {})]
    assert read_whole(_spec("required"), out)[0] is None


def test_a_named_call_streams_its_arguments_as_they_come() -> None:
    spec = _spec({"type": "function", "function": {"name": "get_weather"}})
    stream = ToolStream(spec)
    first = stream.feed('{"ci')
    assert isinstance(first[0], CallStart) and first[0].call.name == "get_weather"
    assert first[1] == CallArguments(0, '{"ci')
    assert stream.feed('ty": "Rome"}') == [CallArguments(0, 'ty": "Rome"}')]
    assert stream.finish() == []
    assert json.loads(stream.calls[0].arguments) == {"city": "Rome"}
    assert tools.delta_for(first[0])["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": "",
    }


def _chat(**fields: object) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_the_chat_request_carries_tools_and_their_constraint() -> None:
    req = parse_chat(_chat(tools=[WEATHER], tool_choice="required"), ["m"])
    assert req.tools is not None and req.tools.mode is Mode.REQUIRED
    assert req.params.structured is not None
    assert parse_chat(_chat(tools=[WEATHER]), ["m"]).params.structured is None
    assert parse_chat(_chat(tools=[WEATHER], tool_choice="none"), ["m"]).tools is None
    history = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    req = parse_chat(_chat(messages=history, tools=[WEATHER]), ["m"])
    assert req.messages[1].tool_calls == (ToolCall("c1", "get_weather", "{}"),)
    assert req.messages[2].tool_call_id == "c1"
    with pytest.raises(ApiError) as err:
        parse_chat(_chat(tools=[WEATHER], tool_choice="maybe"), ["m"])
    assert (err.value.status, err.value.param) == (400, "tool_choice")
    bad_history = [{"role": "assistant", "content": None, "tool_calls": [{"function": 3}]}]
    with pytest.raises(ApiError) as err:
        parse_chat(_chat(messages=bad_history), ["m"])
    assert err.value.param == "messages[0].tool_calls[0]"

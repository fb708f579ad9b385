"""Rendering a checkpoint's Jinja2 chat template, the way Hugging Face transformers does.

The template comes from the checkpoint (``tokenizer.chat_template`` in a GGUF file,
``chat_template`` in ``tokenizer_config.json`` or ``chat_template.jinja`` in a Hugging Face
directory) and is untrusted code, so it runs in jinja2's immutable sandbox. The environment
matches transformers' ``apply_chat_template``: ``trim_blocks``/``lstrip_blocks``, the
``loopcontrols`` extension, a ``{% generation %}`` block tag, a ``tojson`` filter that keeps
non-ASCII text, and the ``raise_exception`` / ``strftime_now`` globals. That makes our rendered
prompt byte-identical to transformers' ``apply_chat_template(..., tokenize=False)``.

A checkpoint without a template gets no guessed format: ``render`` is never reached and the
tokenizer raises ``InvalidRequestError`` (see ``Tokenizer.apply_chat_template``), because a
prompt layout the model was not trained on would silently produce poor output.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import InvalidRequestError, ModelLoadError

CHAT_ROLES: frozenset[str] = frozenset({"system", "user", "assistant", "tool"})


def validate_messages(messages: object) -> list[dict[str, str]]:
    """Check a chat request's messages and return plain-dict copies of them.

    ``messages`` must be a non-empty list (or other non-string sequence) of mappings, each with
    a string ``role`` in ``CHAT_ROLES`` and a string ``content``. Other string-valued keys (such
    as ``name``) are passed through to the template. Raises ``InvalidRequestError`` naming the
    offending index and field.
    """
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise InvalidRequestError(
            f"messages must be a list of {{role, content}} objects, got {type(messages).__name__}"
        )
    if not messages:
        raise InvalidRequestError("messages must contain at least one message")
    checked: list[dict[str, str]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(
                f"messages[{index}] must be an object with role and content, "
                f"got {type(message).__name__}"
            )
        role = message.get("role")
        if not isinstance(role, str):
            raise InvalidRequestError(f"messages[{index}].role must be a string, got {role!r}")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{index}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}"
            )
        content = message.get("content")
        if not isinstance(content, str):
            raise InvalidRequestError(
                f"messages[{index}].content must be a string, got {type(content).__name__}"
            )
        copy: dict[str, str] = {}
        for key, value in message.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise InvalidRequestError(
                    f"messages[{index}].{key} must be a string, got {type(value).__name__}"
                )
            copy[key] = value
        checked.append(copy)
    return checked


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers uses it to mark assistant text
    for training masks; for serving it only renders its body, but templates that use it must
    still compile."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(
            lineno
        )

    def _render_body(self, caller: Any) -> str:
        return str(caller())


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore attributes, closing a route to CPython internals
    (transformers hardens its template namespace the same way)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace: {name!r}"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes, which would corrupt prompts
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    return env


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference.

    Construction compiles the template and raises ``ModelLoadError`` if it does not parse, so a
    broken checkpoint fails at load time rather than on the first request.
    """

    def __init__(self, source: str, *, bos_token: str | None, eos_token: str | None) -> None:
        self.source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ModelLoadError(f"chat template does not parse: {exc}") from exc
        self._special: dict[str, str] = {}
        # Absent tokens stay undefined in the template, as transformers leaves them
        if bos_token is not None:
            self._special["bos_token"] = bos_token
        if eos_token is not None:
            self._special["eos_token"] = eos_token

    def render(self, messages: object, *, add_generation_prompt: bool = True) -> str:
        """Validate ``messages`` (see ``validate_messages``) and render the prompt text.

        A template that rejects the conversation (``raise_exception``, e.g. for roles out of
        order) raises ``InvalidRequestError`` with the template's message.
        """
        checked = validate_messages(messages)
        try:
            return self._template.render(
                messages=checked,
                add_generation_prompt=add_generation_prompt,
                **self._special,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequestError(f"chat template rejected the conversation: {exc}") from exc

"""OpenAI API requests: parse and validate JSON bodies into typed requests (pure functions).

``parse_completion`` / ``parse_chat`` check a decoded JSON body field by field;
``prepare_completion`` / ``prepare_chat`` then template, tokenize and check the request
against the served model's limits, giving the backend's ``GenerateInput``. Every failure is
an ``ApiError`` carrying the HTTP status and OpenAI's error object
``{"error": {"message", "type", "param", "code"}}``.

Supported (OpenAI names, plus vLLM's ``top_k``, ``min_p``, ``stop_token_ids``,
``ignore_eos``, ``repetition_penalty``, ``min_tokens``, ``include_stop_str_in_output``):
``model``, ``prompt`` (a string, a list of token ids, or a one-element list of either),
``messages`` (``content`` a string or a list of ``{"type": "text"}`` parts; ``tool_calls``
and ``tool_call_id`` in the history), ``max_tokens`` (chat: also ``max_completion_tokens``,
which wins), ``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``,
``stream_options.include_usage``, ``presence_penalty``, ``frequency_penalty``,
``logit_bias`` (``engine.penalties``), ``logprobs`` (the sampled tokens' log-probabilities
under the model's raw distribution; completions' ``logprobs`` N and chat's
``top_logprobs`` N also return the N most likely tokens at each step), ``echo``
(completions: the prompt's text before the completion), ``n`` (up to ``MAX_N`` choices,
``services.gateway.choices``), ``tools`` / ``tool_choice`` / ``parallel_tool_calls``
(``services.gateway.tools``), structured outputs (``response_format``, vLLM's
``structured_outputs`` and ``guided_*``: ``services.gateway.structured_api``). Refused:
``best_of`` other than 1, ``echo`` with ``logprobs`` (the prompt tokens' logprobs are not
computed) and ``suffix``. ``user`` and fields we do not know are ignored.

Defaults: ``max_tokens`` is 16 for completions (OpenAI's) and, for chat, the rest of the
context capped at ``Limits.default_chat_max_tokens`` (1024 unless configured).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.errors import CapacityError, InvalidRequestError, ResourceExhaustedError
from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutput
from services.gateway import structured_api, tools
from services.gateway.admission import retry_after_s
from services.gateway.backend import BackendUnavailableError, GenerateInput
from services.gateway.choices import MAX_N
from services.gateway.served_model import ContextLengthError, ServedModel
from services.gateway.tools import ToolCall, ToolSpec

T = TypeVar("T")

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound on the legacy completions ``logprobs``
MAX_TOP_LOGPROBS = 20


class ApiError(Exception):
    """A request that cannot be served, as OpenAI reports it.

    ``status`` is the HTTP status; ``type``/``param``/``code`` are OpenAI's error fields
    (``param`` names the offending request field, or None). ``retry_after_s``: the back-off
    to suggest (the ``Retry-After`` header), or None.
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, param={self.param!r})"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def model_not_found(name: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{name}` does not exist or you do not have access to it.",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


_FIELD_IN_MESSAGE = re.compile(r"^(\w+)=")


def from_engine_error(exc: Exception, prompt_param: str = "prompt") -> ApiError:
    """Map an ``engine.errors`` exception (or a backend's) to the OpenAI error a client sees.

    Raises ``exc`` itself again when it is not one a client caused or can retry.
    """
    if isinstance(exc, ContextLengthError):
        return bad_request(str(exc), prompt_param, "context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        m = _FIELD_IN_MESSAGE.match(str(exc))
        param = m.group(1) if m else None
        if param == "prompt_len":
            param = prompt_param
        return bad_request(str(exc), param)
    if isinstance(exc, CapacityError):
        return bad_request(str(exc), None, "context_length_exceeded")
    if isinstance(exc, ResourceExhaustedError):
        return ApiError(
            429, str(exc), "rate_limit_error", None, "rate_limit_exceeded", retry_after_s(exc)
        )
    if isinstance(exc, BackendUnavailableError):
        return ApiError(503, str(exc), "server_error", None, "service_unavailable")
    raise exc


# -- typed requests --------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """The gateway-side defaults that shape a request."""

    default_max_tokens: int = 16
    default_chat_max_tokens: int = 1024


@dataclass(frozen=True)
class ChatMessage:
    role: str  # one of CHAT_ROLES except "developer", which is read as "system"
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls (history)
    tool_call_id: str = ""  # a tool message's answer to that call


@dataclass(frozen=True)
class CompletionRequest:
    """A validated ``/v1/completions`` body. ``params.max_tokens`` is provisional until
    ``prepare_completion`` applies the default; ``max_tokens`` is what the client sent."""

    model: str
    prompt: str | tuple[int, ...]
    params: SamplingParams
    max_tokens: int | None
    stream: bool
    include_usage: bool
    n: int = 1
    echo: bool = False  # the prompt's text goes before the completion's


@dataclass(frozen=True)
class ChatRequest:
    """A validated ``/v1/chat/completions`` body (see ``CompletionRequest``)."""

    model: str
    messages: tuple[ChatMessage, ...]
    params: SamplingParams
    max_tokens: int | None
    stream: bool
    include_usage: bool
    n: int = 1
    tools: ToolSpec | None = None  # None: no tools (or tool_choice none)


# -- field readers ---------------------------------------------------------------------------


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _wrong_type(name: str, expected: str, value: object) -> ApiError:
    return bad_request(
        f"Invalid type for '{name}': expected {expected}, but got {_type_name(value)} instead.",
        name,
        "invalid_type",
    )


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


class _Body:
    """Typed access to a JSON object's optional fields; null counts as absent."""

    def __init__(self, body: object) -> None:
        if not isinstance(body, dict):
            raise bad_request(
                f"The request body must be a JSON object, got {_type_name(body)}.", None
            )
        self.raw: dict[str, Any] = body

    def get(self, name: str) -> Any:
        return self.raw.get(name)

    def flag(self, name: str, default: bool = False) -> bool:
        v = self.raw.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise _wrong_type(name, "a boolean", v)
        return v

    def integer(self, name: str, *, minimum: int | None = None) -> int | None:
        v = self.raw.get(name)
        if v is None:
            return None
        if not _is_int(v):
            raise _wrong_type(name, "an integer", v)
        if minimum is not None and v < minimum:
            raise bad_request(
                f"Invalid value for '{name}': {v} is less than the minimum of {minimum}.",
                name,
                "invalid_value",
            )
        return v

    def number(self, name: str) -> float | None:
        v = self.raw.get(name)
        if v is None:
            return None
        if not _is_number(v):
            raise _wrong_type(name, "a number", v)
        return v

    def string(self, name: str, *, required: bool = False) -> str | None:
        v = self.raw.get(name)
        if v is None:
            if required:
                raise bad_request(f"Missing required parameter: '{name}'.", name, "missing")
            return None
        if not isinstance(v, str):
            raise _wrong_type(name, "a string", v)
        return v


def _model(body: _Body, models: Collection[str]) -> str:
    name = body.string("model", required=True)
    assert name is not None
    if name not in models:
        raise model_not_found(name)
    return name


def _stream_options(body: _Body) -> tuple[bool, bool]:
    stream = body.flag("stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, dict):
        raise _wrong_type("stream_options", "an object", opts)
    if not stream:
        raise bad_request(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            "stream_options",
        )
    include = opts.get("include_usage")
    if include is None:
        return stream, False
    if not isinstance(include, bool):
        raise _wrong_type("stream_options.include_usage", "a boolean", include)
    return stream, include


def _choices(body: _Body) -> int:
    """``n``: how many choices to generate (``services.gateway.choices``). ``best_of`` (n
    generated, the likeliest returned) is refused, as vLLM's V1 engine refuses it."""
    best_of = body.integer("best_of")
    if best_of is not None and best_of != 1:
        raise bad_request(
            f"'best_of'={best_of} is not supported: every generated choice is returned (use n).",
            "best_of",
        )
    n = body.integer("n", minimum=1)
    if n is not None and n > MAX_N:
        raise bad_request(f"'n' must be at most {MAX_N}, got {n}.", "n")
    return 1 if n is None else n


def _logit_bias(body: _Body) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token ids (as JSON object keys, so strings) to numbers."""
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise _wrong_type("logit_bias", "an object mapping token ids to numbers", bias)
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise bad_request(f"'logit_bias' keys are token ids; got {key!r}.", "logit_bias")
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise _wrong_type(f"logit_bias[{key!r}]", "a number", value)
        out[int(key)] = value
    return out


def _stop(body: _Body) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    if not isinstance(v, list):
        raise _wrong_type("stop", "a string or an array of strings", v)
    for i, s in enumerate(v):
        if not isinstance(s, str):
            raise _wrong_type(f"stop[{i}]", "a string", s)
    return tuple(v)


def _stop_token_ids(body: _Body) -> tuple[int, ...]:
    v = body.get("stop_token_ids")
    if v is None:
        return ()
    if not isinstance(v, list):
        raise _wrong_type("stop_token_ids", "an array of integers", v)
    for i, t in enumerate(v):
        if not _is_int(t):
            raise _wrong_type(f"stop_token_ids[{i}]", "an integer", t)
    return tuple(v)


def _sampling(
    body: _Body, max_tokens: int | None, logprobs: bool, top_logprobs: int = 0
) -> SamplingParams:
    """Build the request's ``SamplingParams`` (with a provisional ``max_tokens`` when absent);
    range errors name the field."""
    temperature = body.number("temperature")
    top_p = body.number("top_p")
    min_p = body.number("min_p")
    top_k = body.integer("top_k")
    seed = body.integer("seed")
    presence = body.number("presence_penalty")
    frequency = body.number("frequency_penalty")
    repetition = body.number("repetition_penalty")
    min_tokens = body.integer("min_tokens", minimum=0)
    numbers = (("temperature", temperature), ("top_p", top_p), ("min_p", min_p),
               ("presence_penalty", presence), ("frequency_penalty", frequency),
               ("repetition_penalty", repetition))  # fmt: skip
    for name, value in numbers:
        if value is not None and not math.isfinite(value):
            raise bad_request(f"'{name}' must be a finite number.", name)
    try:
        return SamplingParams(
            # provisional when absent: the prepare step sets it (and checks min_tokens again)
            max_tokens=max(1, min_tokens or 0) if max_tokens is None else max_tokens,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=0 if top_k is None else top_k,
            min_p=0.0 if min_p is None else min_p,
            seed=seed,
            stop=_stop(body),
            stop_token_ids=_stop_token_ids(body),
            ignore_eos=body.flag("ignore_eos"),
            logprobs=logprobs,
            presence_penalty=presence or 0.0,
            frequency_penalty=frequency or 0.0,
            repetition_penalty=1.0 if repetition is None else repetition,
            logit_bias=_logit_bias(body),
            min_tokens=min_tokens or 0,
            structured=_structured(body),
            top_logprobs=top_logprobs,
            include_stop_str_in_output=body.flag("include_stop_str_in_output"),
        )
    except InvalidRequestError as exc:
        raise from_engine_error(exc) from None


def _structured(body: _Body) -> StructuredOutput | None:
    """The request's structured output (``structured_api``), a 400 naming the parameter."""
    try:
        return structured_api.structured(body.raw)
    except structured_api.ParamError as exc:
        raise bad_request(str(exc), exc.param, exc.code) from None


def _max_tokens(body: _Body, *names: str) -> int | None:
    for name in names:
        v = body.integer(name, minimum=1)
        if v is not None:
            return v
    return None


# -- parsing ---------------------------------------------------------------------------------


def decode_json_body(data: bytes) -> object:
    """Decode a request body: UTF-8, then strict JSON (no NaN/Infinity). Raises ``ApiError``."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(
            f"The request body is not valid UTF-8 (byte {exc.start}: {exc.reason}).",
            None,
            "invalid_encoding",
        ) from None
    if not text.strip():
        raise bad_request("The request body is empty; expected a JSON object.", None)

    def no_constants(name: str) -> None:
        raise ValueError(f"{name} is not valid JSON")

    try:
        return json.loads(text, parse_constant=no_constants)
    except RecursionError:
        raise bad_request("The request body is nested too deeply.", None, "invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, over-long integers
        raise bad_request(
            f"We could not parse the JSON body of your request: {exc}.", None, "invalid_json"
        ) from None


def _prompt(body: _Body) -> str | tuple[int, ...]:
    v = body.get("prompt")
    if v is None:
        raise bad_request("Missing required parameter: 'prompt'.", "prompt", "missing")
    if isinstance(v, list) and v and all(isinstance(p, str | list) for p in v):
        if len(v) > 1:
            raise bad_request(
                f"Batched prompts ({len(v)}) are not supported: send one prompt per request.",
                "prompt",
            )
        v = v[0]  # a batch of one: ["text"] or [[ids]]
    if isinstance(v, str):
        if not v:
            raise bad_request("'prompt' must not be empty.", "prompt")
        return v
    if not isinstance(v, list):
        raise _wrong_type("prompt", "a string or an array of token ids", v)
    if not v:
        raise bad_request("'prompt' must not be empty.", "prompt")
    for i, t in enumerate(v):
        if not _is_int(t):
            raise _wrong_type(f"prompt[{i}]", "an integer token id", t)
    return tuple(v)


def parse_completion(body: object, models: Collection[str]) -> CompletionRequest:
    """Validate a ``/v1/completions`` body. Raises ``ApiError`` (404 for an unknown model)."""
    b = _Body(body)
    model = _model(b, models)
    prompt = _prompt(b)
    suffix = b.string("suffix")
    if suffix:
        raise bad_request("'suffix' is not supported.", "suffix")
    n = _choices(b)
    logprobs, echo = _completion_logprobs(b)
    stream, include_usage = _stream_options(b)
    max_tokens = _max_tokens(b, "max_tokens")
    return CompletionRequest(
        model=model,
        prompt=prompt,
        params=_sampling(b, max_tokens, logprobs is not None, logprobs or 0),
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        n=n,
        echo=echo,
    )


def _content(index: int, role: str, v: object) -> str:
    where = f"messages[{index}].content"
    if v is None:
        if role == "assistant":  # an assistant turn that only called tools
            return ""
        raise bad_request(f"Missing required parameter: '{where}'.", where, "missing")
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise _wrong_type(where, "a string or an array of content parts", v)
    texts = []
    for j, part in enumerate(v):
        if not isinstance(part, dict):
            raise _wrong_type(f"{where}[{j}]", "an object", part)
        kind = part.get("type")
        if kind != "text":
            raise bad_request(
                f"{where}[{j}].type={kind!r} is not supported: only 'text' parts are.",
                f"{where}[{j}].type",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise _wrong_type(f"{where}[{j}].text", "a string", text)
        texts.append(text)
    return "\n".join(texts)


def _messages(body: _Body) -> tuple[ChatMessage, ...]:
    v = body.get("messages")
    if v is None:
        raise bad_request("Missing required parameter: 'messages'.", "messages", "missing")
    if not isinstance(v, list):
        raise _wrong_type("messages", "an array", v)
    if not v:
        raise bad_request("'messages' must contain at least one message.", "messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise _wrong_type(f"messages[{i}]", "an object", m)
        role = m.get("role")
        if role is None:
            raise bad_request(
                f"Missing required parameter: 'messages[{i}].role'.", f"messages[{i}].role"
            )
        if not isinstance(role, str):
            raise _wrong_type(f"messages[{i}].role", "a string", role)
        if role not in CHAT_ROLES:
            raise bad_request(
                f"messages[{i}].role={role!r} is invalid: must be one of {sorted(CHAT_ROLES)}.",
                f"messages[{i}].role",
            )
        content = _content(i, role, m.get("content"))
        calls = _tool_field(tools.parse_history_calls, i, m.get("tool_calls"))
        call_id = m.get("tool_call_id", "")
        if not isinstance(call_id, str):
            raise _wrong_type(f"messages[{i}].tool_call_id", "a string", call_id)
        role = "system" if role == "developer" else role
        out.append(ChatMessage(role, content, calls if role == "assistant" else (), call_id))
    return tuple(out)


def _tool_field(fn: Callable[..., T], *args: object) -> T:
    try:
        return fn(*args)
    except tools.ToolError as exc:
        raise bad_request(str(exc), exc.param) from None


def parse_chat(body: object, models: Collection[str]) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body. Raises ``ApiError`` (404: unknown model)."""
    b = _Body(body)
    model = _model(b, models)
    messages = _messages(b)
    n = _choices(b)
    spec = _tool_field(
        tools.parse_tools, b.get("tools"), b.get("tool_choice"), b.get("parallel_tool_calls")
    )
    logprobs, top = _chat_logprobs(b)
    stream, include_usage = _stream_options(b)
    max_tokens = _max_tokens(b, "max_completion_tokens", "max_tokens")
    params = _sampling(b, max_tokens, logprobs, top)
    constraint = spec.constraint() if spec is not None else None
    if constraint is not None:
        if params.structured is not None:
            raise bad_request(
                "'response_format' cannot constrain the output while 'tool_choice' forces a "
                "call (its arguments' schema constrains it).",
                "response_format",
            )
        params = dataclasses.replace(params, structured=constraint)
    return ChatRequest(
        model=model,
        messages=messages,
        params=params,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        n=n,
        tools=spec if spec is not None and spec.mode is not tools.Mode.NONE else None,
    )


def _completion_logprobs(b: _Body) -> tuple[int | None, bool]:
    """Completions' ``logprobs`` (None: not asked; N: the sampled tokens' and the N most
    likely at each step) and ``echo``. ``echo`` with ``logprobs`` is refused: OpenAI then
    returns the prompt tokens' logprobs too, and no worker computes logits for the prompt's
    positions (prefill keeps only the last one's, and prefix-cached tokens are not computed
    at all), so we would have to lie or leave them out."""
    logprobs = b.integer("logprobs", minimum=0)
    if logprobs is not None and logprobs > MAX_COMPLETION_LOGPROBS:
        raise bad_request(
            f"'logprobs' must be at most {MAX_COMPLETION_LOGPROBS}, got {logprobs}.", "logprobs"
        )
    echo = b.flag("echo")
    if echo and logprobs is not None:
        raise bad_request(
            "'echo' together with 'logprobs' is not supported: the prompt tokens' "
            "log-probabilities are not computed. Use either one alone.",
            "echo",
        )
    return logprobs, echo


def _chat_logprobs(b: _Body) -> tuple[bool, int]:
    """Chat's ``logprobs`` and ``top_logprobs`` (0 to 20, only with ``logprobs``: OpenAI's
    rule)."""
    logprobs = b.flag("logprobs")
    top = b.integer("top_logprobs", minimum=0) or 0
    if top > MAX_TOP_LOGPROBS:
        raise bad_request(
            f"'top_logprobs' must be at most {MAX_TOP_LOGPROBS}, got {top}.", "top_logprobs"
        )
    if top and not logprobs:
        raise bad_request(
            "'top_logprobs' needs 'logprobs' to be true.", "top_logprobs", "invalid_value"
        )
    return logprobs, top


# -- preparing -------------------------------------------------------------------------------


def check_prompt_size(req: CompletionRequest | ChatRequest, model: ServedModel) -> None:
    """Refuse (400, ``context_length_exceeded``) a prompt that cannot fit ``model``'s context
    by its size alone: cheap, so it runs before admission, templating and tokenizing."""
    try:
        if isinstance(req, ChatRequest):
            chars = sum(len(m.content) for m in req.messages)
            chars += len(req.tools.system_text()) if req.tools is not None else 0
            model.check_prompt_chars(chars, "messages")
        elif isinstance(req.prompt, str):
            model.check_prompt_chars(len(req.prompt))
        elif len(req.prompt) >= model.max_model_len:
            model.check_request(req.params, len(req.prompt))
    except InvalidRequestError as exc:
        param = "messages" if isinstance(req, ChatRequest) else "prompt"
        raise from_engine_error(exc, param) from None


def _finish(
    request_id: str,
    model: ServedModel,
    ids: tuple[int, ...],
    params: SamplingParams,
    prompt_param: str,
) -> GenerateInput:
    try:
        model.check_request(params, len(ids))
    except InvalidRequestError as exc:
        raise from_engine_error(exc, prompt_param) from None
    return GenerateInput(request_id, ids, params, model.name)


def _with_max_tokens(params: SamplingParams, max_tokens: int) -> SamplingParams:
    try:
        return dataclasses.replace(params, max_tokens=max_tokens)
    except InvalidRequestError as exc:  # min_tokens above the default max_tokens
        raise from_engine_error(exc) from None


def prepare_completion(
    req: CompletionRequest, model: ServedModel, request_id: str, limits: Limits
) -> GenerateInput:
    """Tokenize the prompt and fix ``max_tokens``; raises ``ApiError`` when it cannot fit."""
    try:
        if isinstance(req.prompt, str):
            ids = model.encode_text(req.prompt)
        else:
            ids = model.check_token_ids(req.prompt)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), "prompt") from None
    max_tokens = req.max_tokens if req.max_tokens is not None else limits.default_max_tokens
    params = _with_max_tokens(req.params, max_tokens)
    return _finish(request_id, model, ids, params, "prompt")


def prepare_chat(
    req: ChatRequest, model: ServedModel, request_id: str, limits: Limits
) -> GenerateInput:
    """Apply the chat template, tokenize, and fix ``max_tokens`` (default: the rest of the
    context, at most ``limits.default_chat_max_tokens``). Raises ``ApiError``."""
    try:
        turns = [tools.Turn(m.role, m.content, m.tool_calls, m.tool_call_id) for m in req.messages]
        ids = model.encode_chat(tools.render(turns, req.tools))
    except InvalidRequestError as exc:
        raise bad_request(str(exc), "messages") from None
    max_tokens = req.max_tokens
    if max_tokens is None:
        max_tokens = max(1, min(limits.default_chat_max_tokens, model.max_model_len - len(ids)))
    params = _with_max_tokens(req.params, max_tokens)
    return _finish(request_id, model, ids, params, "messages")


def echo_text(req: CompletionRequest, model: ServedModel) -> str:
    """What ``echo`` returns before the completion: the prompt as sent, a token prompt's
    text decoded; "" without ``echo``."""
    if not req.echo:
        return ""
    if isinstance(req.prompt, str):
        return req.prompt
    return model.tokenizer.decode(req.prompt)


def lookup(models: Mapping[str, ServedModel], name: str) -> ServedModel:
    """The served model called ``name``; ``ApiError`` 404 if there is none."""
    try:
        return models[name]
    except KeyError:
        raise model_not_found(name) from None

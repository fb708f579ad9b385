"""Protobuf <-> the gateway's dataclasses for the gRPC edge (protobuf stays at the edge).

Inbound conversions raise ``InvalidRequestError`` naming the bad field; the servicer maps
it to INVALID_ARGUMENT.
"""

from __future__ import annotations

from engine.errors import InvalidRequestError
from engine.grammar_text import check
from engine.sampling_params import SamplingParams
from pdserve.v1 import common_pb2, gateway_pb2
from services.common import convert
from services.common.convert import top_logprobs_to_proto
from services.gateway.backend import GenerateChunk
from services.gateway.served_model import ServedModel

MAX_REQUEST_ID_LEN = 128

FINISH_REASONS: dict[str, common_pb2.FinishReason] = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}


def check_request_id(request_id: str) -> str:
    """A caller-chosen id must be <= 128 printable ASCII characters."""
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidRequestError(
            f"request_id is {len(request_id)} characters; at most {MAX_REQUEST_ID_LEN} allowed"
        )
    if not all(" " <= ch <= "~" for ch in request_id):
        raise InvalidRequestError(f"request_id={request_id!r} must be printable ASCII")
    return request_id


def sampling_from_proto(sp: common_pb2.SamplingParams) -> SamplingParams:
    """The engine's ``SamplingParams`` for a proto message: every field, unset ones at the
    defaults written in common.proto (``services.common.convert``, what the workers read),
    and a structured output compiled and checked here, so a bad one is INVALID_ARGUMENT
    before any worker sees it. Raises ``InvalidRequestError`` naming the bad field."""
    params = convert.sampling_from_proto(sp)
    if params.structured is not None:
        try:
            check(params.structured)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"sampling.structured: {exc}") from None
    return params


def check_prompt_size(
    req: gateway_pb2.GenerateRequest, model: ServedModel, params: SamplingParams
) -> None:
    """Refuse by its size alone an input that cannot fit the context (``ContextLengthError``),
    before it is templated or tokenized."""
    kind = req.WhichOneof("input")
    if kind == "prompt":
        model.check_prompt_chars(len(req.prompt))
    elif kind == "chat":
        chars = sum(len(m.content) for m in req.chat.messages)
        model.check_prompt_chars(chars, "chat.messages")
    elif kind == "prompt_token_ids" and len(req.prompt_token_ids.ids) >= model.max_model_len:
        model.check_request(params, len(req.prompt_token_ids.ids))


def prompt_ids(req: gateway_pb2.GenerateRequest, model: ServedModel) -> tuple[int, ...]:
    """Template and tokenize whichever input the request carries."""
    kind = req.WhichOneof("input")
    if kind == "prompt":
        return model.encode_text(req.prompt)
    if kind == "chat":
        messages = [{"role": m.role, "content": m.content} for m in req.chat.messages]
        if not messages:
            raise InvalidRequestError("chat.messages must contain at least one message")
        return model.encode_chat(messages)
    if kind == "prompt_token_ids":
        return model.check_token_ids(list(req.prompt_token_ids.ids), "prompt_token_ids.ids")
    raise InvalidRequestError("one input is required: prompt, chat or prompt_token_ids")


def event(
    request_id: str, chunk: GenerateChunk, *, with_token_ids: bool
) -> gateway_pb2.GenerateEvent:
    """One streamed event (without the last event's usage and timing)."""
    ev = gateway_pb2.GenerateEvent(
        request_id=request_id, text=chunk.text_delta, produced_unix_ns=chunk.produced_unix_ns
    )
    if with_token_ids:
        ev.token_ids.extend(chunk.token_ids)
        ev.logprobs.extend(chunk.logprobs)
        ev.top_logprobs.extend(top_logprobs_to_proto(t) for t in chunk.top_logprobs)
    if chunk.finish_reason is not None:
        ev.finish_reason = FINISH_REASONS.get(
            chunk.finish_reason, common_pb2.FINISH_REASON_UNSPECIFIED
        )
        ev.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=chunk.prompt_tokens,
                completion_tokens=chunk.completion_tokens,
                cached_tokens=chunk.cached_tokens,
            )
        )
    return ev


def model_card(model: ServedModel) -> gateway_pb2.ModelCard:
    return gateway_pb2.ModelCard(
        id=model.name,
        max_model_len=model.max_model_len,
        owned_by=model.owned_by,
        created_unix_s=model.created,
    )

"""The edge of every service: protobuf <-> internal dataclasses, and internal errors ->
gRPC status codes (one mapping, used by every servicer) and the trailing metadata the
workers and the gateway exchange about a failed call."""

from __future__ import annotations

import grpc

from engine.errors import CapacityError, InvalidRequestError, ResourceExhaustedError
from engine.output_processor import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured import StructuredKind, StructuredOutput
from engine.top_logprobs import TopLogprobs
from pdserve.v1 import common_pb2
from transfer.errors import IncompatibleLayoutError, TransferError, TransferTimeout
from transfer.handle import KVLayout, MemoryRegionHandle

_FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}
_FINISH_NAMES = {v: k for k, v in _FINISH.items()}
_STRUCTURED = {
    StructuredKind.JSON_OBJECT: common_pb2.STRUCTURED_KIND_JSON_OBJECT,
    StructuredKind.JSON_SCHEMA: common_pb2.STRUCTURED_KIND_JSON_SCHEMA,
    StructuredKind.REGEX: common_pb2.STRUCTURED_KIND_REGEX,
    StructuredKind.CHOICE: common_pb2.STRUCTURED_KIND_CHOICE,
    StructuredKind.GRAMMAR: common_pb2.STRUCTURED_KIND_GRAMMAR,
}
_STRUCTURED_KINDS = {v: k for k, v in _STRUCTURED.items()}


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """Raises InvalidRequestError (from SamplingParams) on out-of-range values."""
    kwargs: dict[str, object] = {
        "top_k": p.top_k,
        "min_p": p.min_p,
        "stop": tuple(p.stop),
        "stop_token_ids": tuple(p.stop_token_ids),
        "ignore_eos": p.ignore_eos,
        "logprobs": p.logprobs,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "min_tokens": p.min_tokens,
        "logit_bias": dict(p.logit_bias),
        "top_logprobs": p.top_logprobs,
        "include_stop_str_in_output": p.include_stop_str_in_output,
    }
    if p.HasField("repetition_penalty"):
        kwargs["repetition_penalty"] = p.repetition_penalty
    if p.HasField("max_tokens"):
        kwargs["max_tokens"] = p.max_tokens
    if p.HasField("temperature"):
        kwargs["temperature"] = p.temperature
    if p.HasField("top_p"):
        kwargs["top_p"] = p.top_p
    if p.HasField("seed"):
        kwargs["seed"] = p.seed
    if p.HasField("structured"):
        kwargs["structured"] = structured_from_proto(p.structured)
    return SamplingParams(**kwargs)  # type: ignore[arg-type]


def sampling_to_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=max(s.top_k, 0),
        min_p=s.min_p,
        stop=list(s.stop),
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        min_tokens=s.min_tokens,
        logit_bias=dict(s.logit_bias),
        top_logprobs=s.top_logprobs,
        include_stop_str_in_output=s.include_stop_str_in_output,
    )
    if s.repetition_penalty != 1.0:
        p.repetition_penalty = s.repetition_penalty
    if s.seed is not None:
        p.seed = s.seed
    if s.structured is not None:
        p.structured.CopyFrom(structured_to_proto(s.structured))
    return p


def structured_from_proto(p: common_pb2.StructuredOutput) -> StructuredOutput:
    """Raises InvalidRequestError for an unset kind or a spec of the wrong shape."""
    kind = _STRUCTURED_KINDS.get(p.kind)
    if kind is None:
        raise InvalidRequestError(f"sampling.structured.kind={p.kind} is invalid: set a kind")
    return StructuredOutput(kind, p.spec)


def structured_to_proto(s: StructuredOutput) -> common_pb2.StructuredOutput:
    return common_pb2.StructuredOutput(kind=_STRUCTURED[s.kind], spec=s.spec)


def top_logprobs_to_proto(t: TopLogprobs) -> common_pb2.TopLogprobs:
    return common_pb2.TopLogprobs(token_ids=t.token_ids, logprobs=t.logprobs)


def top_logprobs_from_proto(p: common_pb2.TopLogprobs) -> TopLogprobs:
    """Raises InvalidRequestError when the two lists differ in length."""
    if len(p.token_ids) != len(p.logprobs):
        raise InvalidRequestError(
            f"top_logprobs has {len(p.token_ids)} token ids and {len(p.logprobs)} logprobs"
        )
    return TopLogprobs(tuple(p.token_ids), tuple(p.logprobs))


def layout_to_proto(lay: KVLayout) -> common_pb2.KVLayout:
    return common_pb2.KVLayout(
        num_layers=lay.num_layers,
        num_blocks=lay.num_blocks,
        block_size=lay.block_size,
        num_kv_heads=lay.num_kv_heads,
        head_dim=lay.head_dim,
        dtype=lay.dtype,
        order=common_pb2.KV_ORDER_LAYER_KV_BLOCK,
    )


def handle_to_proto(h: MemoryRegionHandle) -> common_pb2.MemoryRegionHandle:
    return common_pb2.MemoryRegionHandle(
        region_id=h.region_id,
        transport=h.transport,
        address=h.address,
        length=h.length,
        key=h.key,
        layout=layout_to_proto(h.layout),
    )


def handle_from_proto(p: common_pb2.MemoryRegionHandle) -> MemoryRegionHandle:
    """Raises TransferError with a clear message on a malformed handle."""
    lay = p.layout
    return MemoryRegionHandle.from_dict(
        {
            "region_id": p.region_id,
            "transport": p.transport,
            "address": p.address,
            "length": p.length,
            "key": p.key,
            "layout": {
                "num_layers": lay.num_layers,
                "num_blocks": lay.num_blocks,
                "block_size": lay.block_size,
                "num_kv_heads": lay.num_kv_heads,
                "head_dim": lay.head_dim,
                "dtype": lay.dtype,
            },
        }
    )


def finish_to_proto(reason: str | None) -> int:
    return _FINISH.get(reason or "", common_pb2.FINISH_REASON_UNSPECIFIED)


def finish_from_proto(value: int) -> str | None:
    return _FINISH_NAMES.get(value)


def usage(out: RequestOutput) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=out.num_prompt_tokens,
        completion_tokens=out.num_output_tokens,
        cached_tokens=out.num_cached_tokens,
    )


# Trailing metadata between the workers and the gateway (docs/api.md, "Metadata keys").
# On DecodeWorker.Generate's error when its Prefill failed: the prefill worker at fault.
FAILED_WORKER_KEY = "pdserve-failed-worker-id"
# On Prefill's error when the writer is known to have stopped: the blocks are free now.
KV_FENCED = ("pdserve-kv-fenced", "1")


def kv_fenced(e: grpc.aio.AioRpcError) -> bool:
    """Whether a failed Prefill call says its writer stopped (``KV_FENCED``)."""
    return KV_FENCED in tuple(e.trailing_metadata() or ())


def status_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, InvalidRequestError | CapacityError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, ResourceExhaustedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, IncompatibleLayoutError):  # the two pools cannot exchange blocks
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, TransferTimeout | TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, TransferError):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Abort the RPC with the status for ``exc`` and its message (never returns)."""
    await context.abort(status_for(exc), f"{type(exc).__name__}: {exc}")

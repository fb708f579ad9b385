"""The edge of every service: protobuf <-> internal dataclasses (one converter per message
and direction; the worker RPCs' typed messages are ``services.common.worker_messages``), and
internal errors -> gRPC status codes (one mapping, used by every servicer) and the trailing
metadata the workers and the gateway exchange about a failed call."""

from __future__ import annotations

import grpc

from engine.errors import CapacityError, InvalidRequestError, ResourceExhaustedError
from engine.output_processor import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured import StructuredKind, StructuredOutput
from engine.top_logprobs import TopLogprobs
from pdserve.v1 import common_pb2, worker_pb2
from services.common.worker_messages import (
    GenerateRequest,
    KVDestination,
    PrefillPlacement,
    PrefillReply,
    PrefillRequest,
)
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


def _request_id(value: str) -> str:
    if not value:
        raise InvalidRequestError("request_id is required")
    return value


def generate_request_from_proto(p: worker_pb2.DecodeGenerateRequest) -> GenerateRequest:
    """Raises InvalidRequestError on a missing request id, a bad sampling parameter or an
    empty prompt (the first found, in that order)."""
    request_id = _request_id(p.request_id)
    sampling = sampling_from_proto(p.sampling)
    if not p.prompt_token_ids:
        raise InvalidRequestError("prompt_token_ids is empty")
    prefill = None
    if p.prefill_address:
        prefill = PrefillPlacement(p.prefill_address, p.prefill_worker_id, p.placement_token)
    return GenerateRequest(
        request_id=request_id,
        prompt_token_ids=tuple(p.prompt_token_ids),
        sampling=sampling,
        resume_token_ids=tuple(p.resume_token_ids),
        prefill=prefill,
        attempt=p.attempt,
        local_prefill_max_tokens=p.local_prefill_max_tokens,
    )


def decode_event_to_proto(
    out: RequestOutput, *, produced_unix_ns: int, kv_transfer_bytes: int, prefill_worker_id: str
) -> worker_pb2.DecodeEvent:
    """``kv_transfer_bytes`` and ``prefill_worker_id`` go on the last event only."""
    ev = worker_pb2.DecodeEvent(
        token_ids=list(out.new_token_ids),
        logprobs=list(out.new_logprobs),
        text=out.text_delta,
        produced_unix_ns=produced_unix_ns,
        top_logprobs=[top_logprobs_to_proto(t) for t in out.new_top_logprobs],
    )
    if out.finished:
        ev.finish_reason = finish_to_proto(out.finish_reason)
        ev.usage.CopyFrom(usage(out))
        ev.kv_transfer_bytes = kv_transfer_bytes
        ev.prefill_worker_id = prefill_worker_id
    return ev


def kv_destination_to_proto(d: KVDestination) -> worker_pb2.KVDestination:
    return worker_pb2.KVDestination(
        region=handle_to_proto(d.region),
        block_ids=d.block_ids,
        num_present_tokens=d.num_present_tokens,
    )


def kv_destination_from_proto(p: worker_pb2.KVDestination) -> KVDestination:
    """Raises TransferError on a malformed region handle (the blocks are checked against
    the request by its reader, ``services.prefill.server``)."""
    return KVDestination(handle_from_proto(p.region), tuple(p.block_ids), p.num_present_tokens)


def prefill_request_to_proto(r: PrefillRequest) -> worker_pb2.PrefillRequest:
    return worker_pb2.PrefillRequest(
        request_id=r.request_id,
        prompt_token_ids=r.prompt_token_ids,
        sampling=sampling_to_proto(r.sampling),
        deadline_ms=int(r.deadline_s * 1000),
        decode_worker_id=r.decode_worker_id,
        placement_token=r.placement_token,
        attempt=r.attempt,
        kv_destination=kv_destination_to_proto(r.kv_destination),
        resume_token_ids=r.resume_token_ids,
    )


def prefill_request_from_proto(p: worker_pb2.PrefillRequest) -> PrefillRequest:
    """Raises InvalidRequestError on a missing request id or a bad sampling parameter,
    TransferError on a malformed region handle (the first found, in that order)."""
    request_id = _request_id(p.request_id)
    sampling = sampling_from_proto(p.sampling)
    return PrefillRequest(
        request_id=request_id,
        prompt_token_ids=tuple(p.prompt_token_ids),
        sampling=sampling,
        kv_destination=kv_destination_from_proto(p.kv_destination),
        deadline_s=p.deadline_ms / 1000,
        decode_worker_id=p.decode_worker_id,
        placement_token=p.placement_token,
        attempt=p.attempt,
        resume_token_ids=tuple(p.resume_token_ids),
    )


def prefill_reply_to_proto(r: PrefillReply) -> worker_pb2.PrefillReply:
    p = worker_pb2.PrefillReply(
        request_id=r.request_id,
        first_token_id=r.first_token_id,
        first_token_logprob=r.first_token_logprob,
        num_cached_tokens=r.num_cached_tokens,
        num_computed_tokens=r.num_computed_tokens,
        kv_transfer_bytes=r.kv_transfer_bytes,
        queue_seconds=r.queue_seconds,
        compute_seconds=r.compute_seconds,
        transfer_seconds=r.transfer_seconds,
        transfer_tail_seconds=r.transfer_tail_seconds,
    )
    if r.first_token_top_logprobs is not None:
        p.first_token_top_logprobs.CopyFrom(top_logprobs_to_proto(r.first_token_top_logprobs))
    return p


def prefill_reply_from_proto(p: worker_pb2.PrefillReply) -> PrefillReply:
    """Raises InvalidRequestError on top logprobs whose two lists differ in length."""
    top = None
    if p.HasField("first_token_top_logprobs"):
        top = top_logprobs_from_proto(p.first_token_top_logprobs)
    return PrefillReply(
        request_id=p.request_id,
        first_token_id=p.first_token_id,
        first_token_logprob=p.first_token_logprob,
        first_token_top_logprobs=top,
        num_cached_tokens=p.num_cached_tokens,
        num_computed_tokens=p.num_computed_tokens,
        kv_transfer_bytes=p.kv_transfer_bytes,
        queue_seconds=p.queue_seconds,
        compute_seconds=p.compute_seconds,
        transfer_seconds=p.transfer_seconds,
        transfer_tail_seconds=p.transfer_tail_seconds,
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

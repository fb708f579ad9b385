"""The worker RPCs' protobuf <-> typed messages (``services.common.convert``): what a
decode worker sends arrives typed as the same values at the prefill worker, and back."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequestError
from engine.output_processor import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured import StructuredKind, StructuredOutput
from engine.top_logprobs import TopLogprobs
from pdserve.v1 import common_pb2, worker_pb2
from services.common.convert import (
    decode_event_to_proto,
    generate_request_from_proto,
    prefill_reply_from_proto,
    prefill_reply_to_proto,
    prefill_request_from_proto,
    prefill_request_to_proto,
    sampling_to_proto,
)
from services.common.worker_messages import (
    KVDestination,
    PrefillPlacement,
    PrefillReply,
    PrefillRequest,
)
from transfer.errors import TransferError
from transfer.handle import KVLayout, MemoryRegionHandle

_REGION = MemoryRegionHandle(
    transport="shm",
    address="/pdserve-kv-decode-0",
    length=4 * 2 * 64 * 16 * 2 * 8 * 2,
    key="k3y",
    layout=KVLayout(
        num_layers=4, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=8, dtype="float16"
    ),
    region_id="decode-0/1",
)
# Values a float32 holds exactly, none of them a default.
_SAMPLING = SamplingParams(
    max_tokens=40,
    temperature=0.5,
    top_k=7,
    top_p=0.75,
    seed=11,
    stop=("\n\n",),
    stop_token_ids=(2,),
    logprobs=True,
    top_logprobs=3,
    repetition_penalty=1.25,
    logit_bias={5: -2.0},
    min_tokens=2,
    structured=StructuredOutput(StructuredKind.REGEX, "[a-z]+"),
)


def test_a_prefill_request_arrives_as_sent() -> None:
    sent = PrefillRequest(
        request_id="r-1",
        prompt_token_ids=(1, 2, 3) * 12,
        sampling=_SAMPLING,
        kv_destination=KVDestination(_REGION, (9, 4, 30), num_present_tokens=16),
        deadline_s=2.5,
        decode_worker_id="decode-0",
        placement_token="tok",
        attempt=2,
        resume_token_ids=(7, 8),
    )
    assert prefill_request_from_proto(prefill_request_to_proto(sent)) == sent
    assert sent.kv_destination.present_blocks == 1


def test_a_prefill_request_without_id_or_with_a_bad_handle_is_refused() -> None:
    good = prefill_request_to_proto(
        PrefillRequest("r", (1,), SamplingParams(), KVDestination(_REGION, (0,)))
    )
    no_id = worker_pb2.PrefillRequest()
    no_id.CopyFrom(good)
    no_id.request_id = ""
    with pytest.raises(InvalidRequestError, match="request_id"):
        prefill_request_from_proto(no_id)
    bad_handle = worker_pb2.PrefillRequest()
    bad_handle.CopyFrom(good)
    bad_handle.kv_destination.region.transport = ""
    with pytest.raises(TransferError, match="transport"):
        prefill_request_from_proto(bad_handle)


@pytest.mark.parametrize("top", [None, TopLogprobs((4, 9), (-0.5, -1.5))])
def test_a_prefill_reply_arrives_as_sent(top: TopLogprobs | None) -> None:
    sent = PrefillReply(
        request_id="r-1",
        first_token_id=42,
        first_token_logprob=-0.25,
        first_token_top_logprobs=top,
        num_cached_tokens=16,
        num_computed_tokens=20,
        kv_transfer_bytes=1 << 20,
        queue_seconds=0.5,
        compute_seconds=1.5,
        transfer_seconds=0.75,
        transfer_tail_seconds=0.125,
    )
    assert prefill_reply_from_proto(prefill_reply_to_proto(sent)) == sent


def test_a_generate_request_names_its_prefill_worker_only_with_an_address() -> None:
    message = worker_pb2.DecodeGenerateRequest(
        request_id="r-2",
        prompt_token_ids=[5, 6],
        sampling=sampling_to_proto(_SAMPLING),
        prefill_address="10.0.0.2:7001",
        prefill_worker_id="prefill-0",
        placement_token="tok",
        attempt=1,
        resume_token_ids=[9],
    )
    req = generate_request_from_proto(message)
    assert (req.request_id, req.prompt_token_ids, req.resume_token_ids) == ("r-2", (5, 6), (9,))
    assert req.sampling == _SAMPLING
    assert req.attempt == 1
    assert req.prefill == PrefillPlacement("10.0.0.2:7001", "prefill-0", "tok")
    message.prefill_address = ""
    assert generate_request_from_proto(message).prefill is None


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"request_id": ""}, "request_id is required"),
        ({"sampling": common_pb2.SamplingParams(max_tokens=0)}, "max_tokens"),
        ({"prompt_token_ids": []}, "prompt_token_ids is empty"),
    ],
)
def test_a_bad_generate_request_is_refused(change: dict[str, object], error: str) -> None:
    fields: dict[str, object] = {"request_id": "r", "prompt_token_ids": [1]}
    fields.update(change)
    with pytest.raises(InvalidRequestError, match=error):
        generate_request_from_proto(worker_pb2.DecodeGenerateRequest(**fields))  # type: ignore[arg-type]


def _output(finished: bool) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        new_token_ids=(3, 4),
        new_logprobs=(-0.5, -1.0),
        text_delta="ab",
        finished=finished,
        finish_reason="length" if finished else None,
        num_prompt_tokens=10,
        num_output_tokens=6,
        num_cached_tokens=8,
        new_top_logprobs=(TopLogprobs((3,), (-0.5,)), TopLogprobs((4,), (-1.0,))),
    )


def test_only_the_last_decode_event_carries_the_outcome() -> None:
    kwargs = {"produced_unix_ns": 123, "kv_transfer_bytes": 4096, "prefill_worker_id": "p-0"}
    middle = decode_event_to_proto(_output(False), **kwargs)  # type: ignore[arg-type]
    assert (list(middle.token_ids), middle.text, middle.produced_unix_ns) == ([3, 4], "ab", 123)
    assert [list(t.token_ids) for t in middle.top_logprobs] == [[3], [4]]
    assert middle.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
    assert (middle.kv_transfer_bytes, middle.prefill_worker_id) == (0, "")
    assert not middle.HasField("usage")
    last = decode_event_to_proto(_output(True), **kwargs)  # type: ignore[arg-type]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (last.kv_transfer_bytes, last.prefill_worker_id) == (4096, "p-0")
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (10, 6)
    assert last.usage.cached_tokens == 8

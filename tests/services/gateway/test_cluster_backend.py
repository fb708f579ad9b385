"""How a decode worker's events become the gateway's chunks (pure conversion): the last
event's usage, prefill worker and KV bytes, with the decode worker that sent it, reach the
last chunk only."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from engine.top_logprobs import TopLogprobs
from pdserve.v1 import common_pb2, worker_pb2
from services.gateway.backend import GenerateInput, ServedBy
from services.gateway.cluster_backend import chunk_from_event

REQ = GenerateInput("r1", (1, 2, 3, 4), SamplingParams(max_tokens=4), "m")


def test_the_last_event_says_who_served_the_request_and_what_moved() -> None:
    middle = worker_pb2.DecodeEvent(token_ids=[7, 8], text="ab", produced_unix_ns=5)
    chunk = chunk_from_event(middle, REQ, 2, "decode-1")
    assert (chunk.finish_reason, chunk.served_by, chunk.cached_tokens) == (None, ServedBy(), 0)
    assert (chunk.token_ids, chunk.text_delta, chunk.completion_tokens) == ((7, 8), "ab", 2)
    last = worker_pb2.DecodeEvent(
        token_ids=[9],
        text="c",
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
        usage=common_pb2.Usage(prompt_tokens=4, completion_tokens=3, cached_tokens=2),
        prefill_worker_id="prefill-0",
        kv_transfer_bytes=4096,
    )
    chunk = chunk_from_event(last, REQ, 3, "decode-1")
    assert chunk.finish_reason == "length"
    assert (chunk.prompt_tokens, chunk.completion_tokens, chunk.cached_tokens) == (4, 3, 2)
    assert chunk.served_by == ServedBy("prefill-0", "decode-1", 4096)


def test_a_local_prefill_names_only_the_decode_worker() -> None:
    last = worker_pb2.DecodeEvent(token_ids=[9], finish_reason=common_pb2.FINISH_REASON_STOP)
    assert chunk_from_event(last, REQ, 1, "decode-0").served_by == ServedBy("", "decode-0", 0)


def test_each_tokens_alternatives_reach_the_chunk() -> None:
    req = GenerateInput("r2", (1, 2), SamplingParams(logprobs=True, top_logprobs=2), "m")
    ev = worker_pb2.DecodeEvent(
        token_ids=[7, 8],
        logprobs=[-0.5, -0.25],
        top_logprobs=[
            common_pb2.TopLogprobs(token_ids=[7, 3], logprobs=[-0.5, -1.5]),
            common_pb2.TopLogprobs(token_ids=[8, 7], logprobs=[-0.25, -2.0]),
        ],
    )
    chunk = chunk_from_event(ev, req, 2, "decode-1")
    assert chunk.logprobs == (-0.5, -0.25)
    assert chunk.top_logprobs == (
        TopLogprobs((7, 3), (-0.5, -1.5)),
        TopLogprobs((8, 7), (-0.25, -2.0)),
    )
    assert chunk_from_event(worker_pb2.DecodeEvent(token_ids=[9]), REQ, 1, "d").top_logprobs == ()

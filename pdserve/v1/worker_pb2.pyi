from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVDestination(_message.Message):
    __slots__ = ("region", "block_ids", "num_present_tokens")
    REGION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PRESENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    region: _common_pb2.MemoryRegionHandle
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_present_tokens: int
    def __init__(self, region: _Optional[_Union[_common_pb2.MemoryRegionHandle, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_present_tokens: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "deadline_ms", "decode_worker_id", "placement_token", "attempt", "kv_destination", "resume_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    KV_DESTINATION_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    deadline_ms: int
    decode_worker_id: str
    placement_token: str
    attempt: int
    kv_destination: KVDestination
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., deadline_ms: _Optional[int] = ..., decode_worker_id: _Optional[str] = ..., placement_token: _Optional[str] = ..., attempt: _Optional[int] = ..., kv_destination: _Optional[_Union[KVDestination, _Mapping]] = ..., resume_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("request_id", "first_token_id", "first_token_logprob", "first_token_top_logprobs", "num_cached_tokens", "num_computed_tokens", "kv_transfer_bytes", "queue_seconds", "compute_seconds", "transfer_seconds", "transfer_tail_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TAIL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    first_token_logprob: float
    first_token_top_logprobs: _common_pb2.TopLogprobs
    num_cached_tokens: int
    num_computed_tokens: int
    kv_transfer_bytes: int
    queue_seconds: float
    compute_seconds: float
    transfer_seconds: float
    transfer_tail_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[float] = ..., first_token_top_logprobs: _Optional[_Union[_common_pb2.TopLogprobs, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., kv_transfer_bytes: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., transfer_tail_seconds: _Optional[float] = ...) -> None: ...

class DecodeGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "prefill_address", "prefill_worker_id", "placement_token", "attempt", "local_prefill_max_tokens", "resume_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    prefill_address: str
    prefill_worker_id: str
    placement_token: str
    attempt: int
    local_prefill_max_tokens: int
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prefill_address: _Optional[str] = ..., prefill_worker_id: _Optional[str] = ..., placement_token: _Optional[str] = ..., attempt: _Optional[int] = ..., local_prefill_max_tokens: _Optional[int] = ..., resume_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("token_ids", "logprobs", "text", "produced_unix_ns", "top_logprobs", "finish_reason", "stop_token_id", "stop_string", "error_message", "usage", "timing", "prefill_worker_id", "kv_transfer_bytes")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PRODUCED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    text: str
    produced_unix_ns: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    stop_string: str
    error_message: str
    usage: _common_pb2.Usage
    timing: _common_pb2.Timing
    prefill_worker_id: str
    kv_transfer_bytes: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., text: _Optional[str] = ..., produced_unix_ns: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., error_message: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ..., prefill_worker_id: _Optional[str] = ..., kv_transfer_bytes: _Optional[int] = ...) -> None: ...

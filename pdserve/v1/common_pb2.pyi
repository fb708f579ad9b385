from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class StructuredKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STRUCTURED_KIND_UNSPECIFIED: _ClassVar[StructuredKind]
    STRUCTURED_KIND_JSON_OBJECT: _ClassVar[StructuredKind]
    STRUCTURED_KIND_JSON_SCHEMA: _ClassVar[StructuredKind]
    STRUCTURED_KIND_REGEX: _ClassVar[StructuredKind]
    STRUCTURED_KIND_CHOICE: _ClassVar[StructuredKind]
    STRUCTURED_KIND_GRAMMAR: _ClassVar[StructuredKind]

class KVOrder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_ORDER_UNSPECIFIED: _ClassVar[KVOrder]
    KV_ORDER_LAYER_KV_BLOCK: _ClassVar[KVOrder]

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_COLOCATED: _ClassVar[WorkerRole]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
STRUCTURED_KIND_UNSPECIFIED: StructuredKind
STRUCTURED_KIND_JSON_OBJECT: StructuredKind
STRUCTURED_KIND_JSON_SCHEMA: StructuredKind
STRUCTURED_KIND_REGEX: StructuredKind
STRUCTURED_KIND_CHOICE: StructuredKind
STRUCTURED_KIND_GRAMMAR: StructuredKind
KV_ORDER_UNSPECIFIED: KVOrder
KV_ORDER_LAYER_KV_BLOCK: KVOrder
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_COLOCATED: WorkerRole

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "include_stop_str_in_output", "logprobs", "logit_bias", "top_logprobs", "structured")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    include_stop_str_in_output: bool
    logprobs: bool
    logit_bias: _containers.ScalarMap[int, float]
    top_logprobs: int
    structured: StructuredOutput
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., top_logprobs: _Optional[int] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: StructuredKind
    spec: str
    def __init__(self, kind: _Optional[_Union[StructuredKind, str]] = ..., spec: _Optional[str] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_seconds", "prefill_seconds", "kv_transfer_seconds", "first_token_seconds", "total_seconds")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    prefill_seconds: float
    kv_transfer_seconds: float
    first_token_seconds: float
    total_seconds: float
    def __init__(self, queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., kv_transfer_seconds: _Optional[float] = ..., first_token_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "dtype", "order")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    order: KVOrder
    def __init__(self, num_layers: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., order: _Optional[_Union[KVOrder, str]] = ...) -> None: ...

class MemoryRegionHandle(_message.Message):
    __slots__ = ("region_id", "transport", "address", "length", "key", "layout", "transport_params")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_PARAMS_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    transport: str
    address: str
    length: int
    key: str
    layout: KVLayout
    transport_params: bytes
    def __init__(self, region_id: _Optional[str] = ..., transport: _Optional[str] = ..., address: _Optional[str] = ..., length: _Optional[int] = ..., key: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., transport_params: _Optional[bytes] = ...) -> None: ...

class WorkerCapacity(_message.Message):
    __slots__ = ("total_kv_blocks", "block_size", "max_num_seqs", "max_model_len", "max_num_batched_tokens")
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    total_kv_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    def __init__(self, total_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "grpc_address", "metrics_address", "transports", "model", "capacity", "host_id", "started_unix_ns", "version", "kv_region_digest", "kv_store")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KV_REGION_DIGEST_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: WorkerRole
    grpc_address: str
    metrics_address: str
    transports: _containers.RepeatedScalarFieldContainer[str]
    model: str
    capacity: WorkerCapacity
    host_id: str
    started_unix_ns: int
    version: str
    kv_region_digest: str
    kv_store: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., grpc_address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., transports: _Optional[_Iterable[str]] = ..., model: _Optional[str] = ..., capacity: _Optional[_Union[WorkerCapacity, _Mapping]] = ..., host_id: _Optional[str] = ..., started_unix_ns: _Optional[int] = ..., version: _Optional[str] = ..., kv_region_digest: _Optional[str] = ..., kv_store: _Optional[str] = ...) -> None: ...

from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_SERVING: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_SERVING: WorkerState
WORKER_STATE_DRAINING: WorkerState

class PlaceRequest(_message.Message):
    __slots__ = ("request_id", "model", "attempt", "exclude_worker_ids", "prompt_tokens", "max_tokens", "prompt_block_hashes", "hash_block_size")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    HASH_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    attempt: int
    exclude_worker_ids: _containers.RepeatedScalarFieldContainer[str]
    prompt_tokens: int
    max_tokens: int
    prompt_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    hash_block_size: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., attempt: _Optional[int] = ..., exclude_worker_ids: _Optional[_Iterable[str]] = ..., prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., prompt_block_hashes: _Optional[_Iterable[int]] = ..., hash_block_size: _Optional[int] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("request_id", "prefill", "decode", "expected_cached_tokens", "placement_token", "local_prefill_max_tokens", "fleet_target_batch")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FLEET_TARGET_BATCH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill: _common_pb2.WorkerInfo
    decode: _common_pb2.WorkerInfo
    expected_cached_tokens: int
    placement_token: str
    local_prefill_max_tokens: int
    fleet_target_batch: int
    def __init__(self, request_id: _Optional[str] = ..., prefill: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., decode: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ..., expected_cached_tokens: _Optional[int] = ..., placement_token: _Optional[str] = ..., local_prefill_max_tokens: _Optional[int] = ..., fleet_target_batch: _Optional[int] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: _common_pb2.WorkerInfo
    def __init__(self, worker: _Optional[_Union[_common_pb2.WorkerInfo, _Mapping]] = ...) -> None: ...

class RegisterWorkerReply(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "lease_ttl_ms", "placement_verify_key")
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_VERIFY_KEY_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    lease_ttl_ms: int
    placement_verify_key: bytes
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ..., placement_verify_key: _Optional[bytes] = ...) -> None: ...

class LoadSnapshot(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "free_kv_blocks", "total_kv_blocks", "queued_prompt_tokens", "target_batch")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TARGET_BATCH_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    free_kv_blocks: int
    total_kv_blocks: int
    queued_prompt_tokens: int
    target_batch: int
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., queued_prompt_tokens: _Optional[int] = ..., target_batch: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "state", "sequence", "load", "cached_block_hashes_added", "cached_block_hashes_removed", "cache_snapshot", "stored_block_hashes", "store_missing_block_hashes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCK_HASHES_ADDED_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCK_HASHES_REMOVED_FIELD_NUMBER: _ClassVar[int]
    CACHE_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    STORE_MISSING_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    state: WorkerState
    sequence: int
    load: LoadSnapshot
    cached_block_hashes_added: _containers.RepeatedScalarFieldContainer[int]
    cached_block_hashes_removed: _containers.RepeatedScalarFieldContainer[int]
    cache_snapshot: bool
    stored_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    store_missing_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[str] = ..., state: _Optional[_Union[WorkerState, str]] = ..., sequence: _Optional[int] = ..., load: _Optional[_Union[LoadSnapshot, _Mapping]] = ..., cached_block_hashes_added: _Optional[_Iterable[int]] = ..., cached_block_hashes_removed: _Optional[_Iterable[int]] = ..., cache_snapshot: _Optional[bool] = ..., stored_block_hashes: _Optional[_Iterable[int]] = ..., store_missing_block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("resync_cache", "heartbeat_interval_ms", "placement_verify_key")
    RESYNC_CACHE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_VERIFY_KEY_FIELD_NUMBER: _ClassVar[int]
    resync_cache: bool
    heartbeat_interval_ms: int
    placement_verify_key: bytes
    def __init__(self, resync_cache: _Optional[bool] = ..., heartbeat_interval_ms: _Optional[int] = ..., placement_verify_key: _Optional[bytes] = ...) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DeregisterWorkerReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Outcome(_message.Message):
    __slots__ = ("request_id", "attempt", "prefill_worker_id", "decode_worker_id", "finish_reason", "error_code", "error_message", "usage", "arrival_unix_ns", "first_token_unix_ns", "finish_unix_ns", "kv_transfer_bytes", "kv_transfer_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    FINISH_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    attempt: int
    prefill_worker_id: str
    decode_worker_id: str
    finish_reason: _common_pb2.FinishReason
    error_code: int
    error_message: str
    usage: _common_pb2.Usage
    arrival_unix_ns: int
    first_token_unix_ns: int
    finish_unix_ns: int
    kv_transfer_bytes: int
    kv_transfer_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., attempt: _Optional[int] = ..., prefill_worker_id: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., arrival_unix_ns: _Optional[int] = ..., first_token_unix_ns: _Optional[int] = ..., finish_unix_ns: _Optional[int] = ..., kv_transfer_bytes: _Optional[int] = ..., kv_transfer_seconds: _Optional[float] = ...) -> None: ...

class ReportOutcomeReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

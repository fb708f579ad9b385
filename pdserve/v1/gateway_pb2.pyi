from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt", "chat", "prompt_token_ids", "sampling", "return_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt: str
    chat: _common_pb2.ChatMessages
    prompt_token_ids: _common_pb2.TokenIds
    sampling: _common_pb2.SamplingParams
    return_token_ids: bool
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt: _Optional[str] = ..., chat: _Optional[_Union[_common_pb2.ChatMessages, _Mapping]] = ..., prompt_token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., return_token_ids: _Optional[bool] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "logprobs", "produced_unix_ns", "top_logprobs", "finish_reason", "stop_token_id", "stop_string", "error_message", "usage", "timing")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRODUCED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    produced_unix_ns: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    stop_string: str
    error_message: str
    usage: _common_pb2.Usage
    timing: _common_pb2.Timing
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., produced_unix_ns: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., error_message: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsReply(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelCard]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelCard, _Mapping]]] = ...) -> None: ...

class ModelCard(_message.Message):
    __slots__ = ("id", "max_model_len", "owned_by", "created_unix_s")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    OWNED_BY_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    id: str
    max_model_len: int
    owned_by: str
    created_unix_s: int
    def __init__(self, id: _Optional[str] = ..., max_model_len: _Optional[int] = ..., owned_by: _Optional[str] = ..., created_unix_s: _Optional[int] = ...) -> None: ...

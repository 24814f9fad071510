from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenMessage(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "finish_reason", "text", "error", "error_code", "events", "cached_tokens", "first_index", "draft_tokens", "accepted_draft_tokens", "prompt_tokens")
    class EventsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    text: str
    error: str
    error_code: str
    events: _containers.ScalarMap[str, float]
    cached_tokens: int
    first_index: int
    draft_tokens: int
    accepted_draft_tokens: int
    prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., text: _Optional[str] = ..., error: _Optional[str] = ..., error_code: _Optional[str] = ..., events: _Optional[_Mapping[str, float]] = ..., cached_tokens: _Optional[int] = ..., first_index: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[TokenMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[TokenMessage, _Mapping]]] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("block_hash", "parent_hash", "removed")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    block_hash: bytes
    parent_hash: bytes
    removed: bool
    def __init__(self, block_hash: _Optional[bytes] = ..., parent_hash: _Optional[bytes] = ..., removed: _Optional[bool] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("worker_id", "epoch", "first_seq", "events")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: str
    first_seq: int
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[str] = ..., first_seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...

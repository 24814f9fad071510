from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "max_tokens", "stop_token_ids", "stop", "ignore_eos", "logprobs", "speculative", "proposer")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: bool
    speculative: bool
    proposer: str
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., speculative: _Optional[bool] = ..., proposer: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "text", "token_ids", "params", "request_id", "images")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    token_ids: TokenIds
    params: SamplingParams
    request_id: str
    images: _containers.RepeatedCompositeFieldContainer[Image]
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queued_s", "prefill_s", "kv_transfer_s", "decode_s", "ttft_s", "e2e_s", "events")
    class EventsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    queued_s: float
    prefill_s: float
    kv_transfer_s: float
    decode_s: float
    ttft_s: float
    e2e_s: float
    events: _containers.ScalarMap[str, float]
    def __init__(self, queued_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., kv_transfer_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., e2e_s: _Optional[float] = ..., events: _Optional[_Mapping[str, float]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text_delta", "logprobs", "finish_reason", "timings", "prompt_tokens", "cached_tokens", "server_request_id", "draft_tokens", "accepted_draft_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SERVER_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text_delta: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    timings: Timings
    prompt_tokens: int
    cached_tokens: int
    server_request_id: str
    draft_tokens: int
    accepted_draft_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text_delta: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., server_request_id: _Optional[str] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "text")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "model_type", "vocab_size", "max_model_len", "mode", "dtype", "block_size", "eos_token_id", "eos_token_ids", "image_token", "image_token_id", "max_images", "max_image_bytes", "max_image_pixels")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    IMAGE_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_PIXELS_FIELD_NUMBER: _ClassVar[int]
    name: str
    model_type: str
    vocab_size: int
    max_model_len: int
    mode: str
    dtype: str
    block_size: int
    eos_token_id: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    image_token: str
    image_token_id: int
    max_images: int
    max_image_bytes: int
    max_image_pixels: int
    def __init__(self, name: _Optional[str] = ..., model_type: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., mode: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., image_token: _Optional[str] = ..., image_token_id: _Optional[int] = ..., max_images: _Optional[int] = ..., max_image_bytes: _Optional[int] = ..., max_image_pixels: _Optional[int] = ...) -> None: ...

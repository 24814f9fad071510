from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class KVFrame(_message.Message):
    __slots__ = ("transfer_id", "layer", "start_token", "num_tokens", "codec", "level", "crc32", "payload_bytes", "offset", "payload")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    layer: int
    start_token: int
    num_tokens: int
    codec: str
    level: int
    crc32: int
    payload_bytes: int
    offset: int
    payload: bytes
    def __init__(self, transfer_id: _Optional[str] = ..., layer: _Optional[int] = ..., start_token: _Optional[int] = ..., num_tokens: _Optional[int] = ..., codec: _Optional[str] = ..., level: _Optional[int] = ..., crc32: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class KVAck(_message.Message):
    __slots__ = ("frames", "corrupt_frames", "error")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FRAMES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    frames: int
    corrupt_frames: int
    error: str
    def __init__(self, frames: _Optional[int] = ..., corrupt_frames: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

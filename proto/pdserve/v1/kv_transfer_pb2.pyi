from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class KVChunk(_message.Message):
    __slots__ = ("transfer_id", "layer", "offset", "layer_bytes", "payload", "crc32")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LAYER_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    layer: int
    offset: int
    layer_bytes: int
    payload: bytes
    crc32: int
    def __init__(self, transfer_id: _Optional[str] = ..., layer: _Optional[int] = ..., offset: _Optional[int] = ..., layer_bytes: _Optional[int] = ..., payload: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class KVAck(_message.Message):
    __slots__ = ("layers_received", "error")
    LAYERS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    layers_received: int
    error: str
    def __init__(self, layers_received: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

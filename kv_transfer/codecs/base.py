"""What the codecs share: the error a codec raises when it cannot be used, and payload byte handling."""

from __future__ import annotations

import numpy as np
import torch

from pdserve.kv_transfer.interface import CorruptFrame, Payload


class CodecUnavailable(RuntimeError):
    """A codec cannot be used here: unknown name, no torch support, or no matching tables for the model."""


class Unrepresentable(ValueError):
    """KV a codec cannot carry (int8 and fp8 scale each token by its absmax: inf or NaN has none).
    The sender sends that frame raw, which every receiver takes whatever codec was agreed."""


def rounded_like(bound: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """A bound on |x - decoded| for values decoded in float32, widened by their rounding to kv's
    dtype (the engine's, which `decode` is asked for): half an ulp of |x| + bound at most."""
    finfo = torch.finfo(kv.dtype)
    magnitude = kv.detach().to("cpu", torch.float64).abs() + bound  # float64: |x| + bound may pass float32's range
    return (bound + magnitude * (finfo.eps / 2) + finfo.smallest_normal * finfo.eps / 2).to(torch.float32)


def payload_bytes(payload: Payload) -> np.ndarray:
    """A flat uint8 view of a payload's bytes (no copy of host bytes; a tensor on a device is copied
    to the host); read-only when the payload is."""
    if isinstance(payload, torch.Tensor):
        return tensor_bytes(payload)
    if isinstance(payload, np.ndarray):
        if not payload.flags.c_contiguous:
            raise CorruptFrame("payload array is not contiguous")
        return payload.reshape(-1).view(np.uint8)
    return np.frombuffer(payload, dtype=np.uint8)


def payload_nbytes(payload: Payload) -> int:
    return payload.nbytes if isinstance(payload, torch.Tensor) else memoryview(payload).nbytes


def device_bytes(payload: Payload, device: torch.device) -> torch.Tensor:
    """A payload as a flat uint8 tensor on `device` (a view when it is there already)."""
    if isinstance(payload, torch.Tensor):
        return payload.reshape(-1).view(torch.uint8).to(device)
    data = payload_bytes(payload)
    return torch.from_numpy(data if data.flags.writeable else data.copy()).to(device)


def tensor_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A flat uint8 view of a tensor's bytes, copied only when it is not a contiguous CPU tensor
    (bfloat16 has no numpy dtype, bytes always do)."""
    return tensor.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy()


def bytes_as_tensor(data: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The bytes `data` as a flat tensor of `dtype`: a view when the buffer allows it, else one copy
    (torch wants writable memory, and aligned memory for its element type)."""
    if not data.flags.writeable or data.ctypes.data % element_size(dtype):
        data = data.copy()
    return torch.from_numpy(data).view(dtype)


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def check_encode_level(name: str, level: int, num_levels: int) -> None:
    if not 0 <= level < num_levels:
        raise ValueError(f"codec {name!r} has levels 0..{num_levels - 1}, got {level}")


def check_decode_level(name: str, level: int, num_levels: int) -> None:
    if not 0 <= level < num_levels:
        raise CorruptFrame(f"frame of codec {name!r} at level {level}; it has levels 0..{num_levels - 1}")


def expect_size(name: str, got: int, expected: int) -> None:
    if got != expected:
        raise CorruptFrame(f"{name} payload of {got} bytes, expected {expected}")

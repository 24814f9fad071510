"""CUDA streams of the KV transfer's own threads. The engine's steps run on the device's default
stream; KV read out of the cache for sending, or written into reserved blocks as frames arrive, goes
on a stream of the transfer thread's own, so it neither waits behind the steps queued there nor
delays them. Elsewhere than CUDA these change nothing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# One per thread (the prefill worker sends from one per decode worker; frames arrive on each
# transport's threads): a shared stream would make each thread's synchronize wait for the others too.
_streams = threading.local()


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's own stream on `device`."""
    streams = getattr(_streams, "by_device", None)
    if streams is None:
        streams = _streams.by_device = {}
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


@contextmanager
def off_the_compute_stream(device: torch.device) -> Iterator[None]:
    """What runs inside queues on this thread's side stream, after what the compute stream has queued
    so far (this layer's writes included): reading a layer out never delays the next layer's kernels;
    only the sending thread waits for it."""
    if device.type != "cuda":
        yield
        return
    side = side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield


@contextmanager
def beside_the_engine(device: torch.device) -> Iterator[None]:
    """What runs inside (a frame's copies into reserved blocks) queues on this thread's side stream,
    or on the stream the transport made current (NCCL: its group's), not behind the engine's steps,
    and has landed when the block ends: the caller then lets an abort free the blocks, which the
    engine's next step may hand to another request. No wait for the engine's stream first: blocks are
    reserved between steps, and no step queued then touches them."""
    if device.type != "cuda":
        yield
        return
    stream = torch.cuda.current_stream(device)
    if stream == torch.cuda.default_stream(device):
        stream = side_stream(device)
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()

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
# Every stream the KV transfer makes is of high priority: torch hands streams out in turn from a pool of
# 32 per device and priority, and NCCL's groups take theirs from the default priority's pool; one
# shared with them would make a synchronize here wait on a send or receive stuck on a peer. (Past 32
# streams, ours share.) The streams a receiving group waits on for its peer's sends come from a pool
# of their own (a priority higher still, so GPUs with three priorities or more keep the two apart):
# a receiving thread's synchronize never waits on another pair's stalled receive.
HIGH_PRIORITY = -1
GROUP_PRIORITY = -2


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's own stream on `device`."""
    streams = getattr(_streams, "by_device", None)
    if streams is None:
        streams = _streams.by_device = {}
    if device not in streams:
        streams[device] = torch.cuda.Stream(device, priority=HIGH_PRIORITY)
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
    """What runs inside (a frame's checks, decoding and copy into reserved blocks) queues on this
    thread's side stream, or on the stream the transport made current (NCCL: its group's), not
    behind the engine's steps; `landed` waits for it. No wait for the engine's stream first: blocks
    are reserved between steps, each of which the engine waits for, so none queued touches them."""
    if device.type != "cuda" or torch.cuda.current_stream(device) != torch.cuda.default_stream(device):
        yield
        return
    with torch.cuda.stream(side_stream(device)):
        yield


def landed(device: torch.device) -> None:
    """Wait for what this thread queued on its current stream: before letting an abort free blocks
    it wrote, which the engine's next step may hand to another request."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()

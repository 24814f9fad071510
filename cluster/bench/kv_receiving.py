"""The receiving half of `pdserve bench kv`'s transport runs, in a child process of its own.

Apart from the benchmark's module because a `spawn` child imports its target's module: this one
imports the transports alone (about 2 s of CPU), not transformers' modeling code as well (about 7 s
more, for every transport set up).
"""

from __future__ import annotations

import socket
from multiprocessing.connection import Connection

import numpy as np
import torch

from pdserve.kv_transfer.interface import FrameHeader
from pdserve.kv_transfer.transports import start_receiver


def receive_into_one_buffer(kind: str, capacity: int, conn: Connection) -> None:
    """Child: a receiving half (or a TCP listener) that copies every frame into one buffer."""
    buffer = np.empty(capacity, dtype=np.uint8)
    if kind == "socket":
        listener = socket.create_server(("127.0.0.1", 0))
        conn.send(f"127.0.0.1:{listener.getsockname()[1]}")
        peer, _ = listener.accept()
        view = memoryview(buffer)
        while (want := conn.recv()) is not None:  # bytes to take, then answer one byte
            got = 0
            while got < want:
                got += peer.recv_into(view[got % capacity :], min(want - got, capacity - got % capacity))
            peer.sendall(b"k")
        peer.close()
        listener.close()
        return
    position = [0]
    if kind == "nccl":  # the receiving rank on a GPU of its own: NCCL refuses two ranks on one device
        if torch.cuda.device_count() < 2:
            conn.send(None)  # the parent says why, instead of waiting for an address
            return
        torch.cuda.set_device(1)
        on_gpu = torch.empty(capacity, dtype=torch.uint8, device="cuda")

    class Sink:
        def admit_frame(self, header: FrameHeader) -> None:
            pass

        def receive_frame(self, header: FrameHeader, payload: memoryview | torch.Tensor) -> None:
            start = position[0] % (capacity - header.payload_bytes + 1)
            if isinstance(payload, torch.Tensor):
                on_gpu[start : start + header.payload_bytes].copy_(payload)
            else:
                buffer[start : start + header.payload_bytes] = np.frombuffer(payload, np.uint8)
            position[0] += header.payload_bytes

    receiver = start_receiver(kind, Sink())
    conn.send(receiver.address)
    conn.recv()  # told to stop
    receiver.stop()

"""Faults injected on purpose, from the manifest's `faults:` section: for tests, soak runs and drills.

A worker gets the `FaultSettings` meant for it and asks its `FaultInjector` at a few points:

- `took_request()` when it accepts a request: after `kill_after_requests` of them the process kills
  itself with SIGKILL (as the OOM killer or a lost node would), requests in flight and all. Only the
  first incarnation does: Ray's restart of it serves normally, so one setting is one fault.
- `after_step()` on the engine loop: every `stall_every_steps`-th step stalls `stall_ms` (a hung
  kernel, a noisy neighbour).
- `channel(...)` wraps each KV-transfer channel the worker opens: `kv_delay_ms` before each frame (a
  slow link), `kv_drop_percent` of frames never sent, `kv_corrupt_percent` sent with one byte flipped
  (the receiver's checksum catches it).

Every decision comes from one seeded generator per worker, and what was injected is counted
(`counts`), so a drill can report what it did. No torch here.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FaultSettings:
    kill_after_requests: int | None = None
    stall_every_steps: int = 0  # 0: never
    stall_ms: float = 0.0
    kv_drop_percent: float = 0.0
    kv_corrupt_percent: float = 0.0
    kv_delay_ms: float = 0.0
    seed: int = 0

    @property
    def kv_faults(self) -> bool:
        return bool(self.kv_drop_percent or self.kv_corrupt_percent or self.kv_delay_ms)


class FaultInjector:
    def __init__(self, settings: FaultSettings | None, first_incarnation: bool = True) -> None:
        self.settings = settings or FaultSettings()
        self.counts: Counter[str] = Counter()
        self._kill_armed = first_incarnation and self.settings.kill_after_requests is not None
        self._rng = random.Random(self.settings.seed)
        self._lock = threading.Lock()  # requests and frames come from several threads
        self._requests = 0
        self._steps = 0

    def took_request(self) -> None:
        with self._lock:
            self._requests += 1
            due = self._kill_armed and self._requests >= self.settings.kill_after_requests
        if due:
            os.kill(os.getpid(), signal.SIGKILL)

    def after_step(self) -> None:
        s = self.settings
        if not s.stall_every_steps:
            return
        self._steps += 1  # only the engine loop's thread counts steps
        if self._steps % s.stall_every_steps == 0:
            self.counts["stalls"] += 1
            time.sleep(s.stall_ms / 1000)

    def channel(self, channel: Any) -> Any:
        """`channel` as it is, or wrapped to delay, drop and corrupt frames when the settings say so."""
        return _FaultyChannel(channel, self) if self.settings.kv_faults else channel

    def frame(self, payload: Any) -> Any:
        """What to send instead of `payload` (a memoryview, or a uint8 tensor on a device), after the
        delay: None to drop it, a damaged copy, or it."""
        s = self.settings
        if s.kv_delay_ms:
            time.sleep(s.kv_delay_ms / 1000)
        with self._lock:
            draw = self._rng.uniform(0, 100)
            position = self._rng.randrange(max(1, payload.nbytes))
        if draw < s.kv_drop_percent:
            self.counts["kv_dropped"] += 1
            return None
        if draw < s.kv_drop_percent + s.kv_corrupt_percent and payload.nbytes:
            self.counts["kv_corrupted"] += 1
            damaged = payload.clone() if hasattr(payload, "clone") else bytearray(payload)  # clone: a device tensor
            damaged[position] ^= 0xFF
            return damaged
        return payload


class _FaultyChannel:
    """A KV channel whose frames pass through the injector; everything else is the channel's own."""

    def __init__(self, channel: Any, injector: FaultInjector) -> None:
        self._channel = channel
        self._injector = injector

    def send(self, header: Any, payload: Any) -> None:
        sent = self._injector.frame(payload)
        if sent is not None:
            self._channel.send(header, sent)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._channel, name)

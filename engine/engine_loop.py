"""Runs an LLMEngine on its own thread; other threads reach it only through `call`.

The engine is single-threaded by design. Workers get requests, KV imports and aborts from other
threads (Ray method calls, gRPC handlers); each becomes a command that the loop runs between two
steps, so nothing touches the block pool while a step is in flight.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import RequestOutput

T = TypeVar("T")
log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_outputs: Callable[[list[RequestOutput]], None],
                 idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._on_outputs = on_outputs
        self._idle_wait_s = idle_wait_s
        self._commands: queue.Queue[tuple[Callable[[LLMEngine], object], Future]] = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.fatal_error: BaseException | None = None

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._thread.join(timeout)

    def submit(self, fn: Callable[[LLMEngine], T]) -> "Future[T]":
        """Run `fn(engine)` on the loop thread before the next step."""
        future: Future[T] = Future()
        if self.fatal_error is not None or self._stopping.is_set():
            future.set_exception(RuntimeError(f"engine loop is not running ({self.fatal_error or 'stopped'})"))
            return future
        self._commands.put((fn, future))
        return future

    def call(self, fn: Callable[[LLMEngine], T], timeout: float | None = 60.0) -> T:
        return self.submit(fn).result(timeout)

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            self._run_commands(block=not engine.has_unfinished_requests())
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except BaseException as e:  # a broken step must not hang callers: fail loudly and stop
                log.exception("engine step failed")
                self.fatal_error = e
                break
            if outputs:
                self._on_outputs(outputs)
        self._fail_pending()

    def _run_commands(self, block: bool) -> None:
        try:
            fn, future = self._commands.get(timeout=self._idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as e:
                    future.set_exception(e)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _fail_pending(self) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            future.set_exception(RuntimeError(f"engine loop stopped ({self.fatal_error or 'shutdown'})"))

"""Runs an LLMEngine on its own thread; other threads reach it only through `submit` / `call`.

The engine is single-threaded by design. Workers get requests, KV imports and aborts from other
threads (Ray method calls, gRPC handlers); each becomes a command that the loop runs between two
steps, so nothing touches the block pool while a step is in flight.

The loop never dies silently: an exception in a step or in the output callback is logged with its
traceback, handed to `on_fatal` (the worker fails every request it holds), and stops the loop;
`fatal_error` then says why, and the worker reports itself unhealthy. When no request can be
scheduled (nothing to do, or waiting requests that do not fit), the loop sleeps until a command
arrives instead of spinning. It keeps a busy-time account (`busy`): forward pass, KV
import/export commands and everything else, against wall time.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from typing import Literal, TypeVar

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import RequestOutput

T = TypeVar("T")
CommandKind = Literal["kv", "other"]
log = logging.getLogger(__name__)


class LoopStopped(RuntimeError):
    """A command that the loop will not run: it has stopped (shut down, or after a fatal error)."""


@dataclass
class BusyTime:
    """Seconds of the loop thread's time, cumulative since the loop started."""

    wall_s: float = 0.0
    forward_s: float = 0.0  # the model's forward pass
    kv_s: float = 0.0  # KV import/export commands
    other_s: float = 0.0  # scheduling, sampling, other commands, output callbacks
    steps: int = 0


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_outputs: Callable[[list[RequestOutput]], None],
                 on_fatal: Callable[[BaseException], None] | None = None, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self._on_outputs = on_outputs
        self._on_fatal = on_fatal
        self._idle_wait_s = idle_wait_s
        self._commands: queue.Queue[tuple[Callable[[LLMEngine], object], Future, CommandKind]] = queue.Queue()
        # A command is queued, or the ended loop's last drain runs, under it: none is queued after that drain.
        self._queueing = threading.Lock()
        self._closed = False
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._busy = BusyTime()
        self._started_at = 0.0
        # Bumped after every pass of the loop: threads waiting for the engine to move on (a
        # reservation waiting for free blocks, the prefill feeder waiting for room) wait on it.
        self._progress = threading.Condition()
        self._generation = 0
        self.fatal_error: BaseException | None = None

    def start(self) -> "EngineLoop":
        self._started_at = time.perf_counter()
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and self.fatal_error is None and not self._stopping.is_set()

    def submit(self, fn: Callable[[LLMEngine], T], kind: CommandKind = "other") -> "Future[T]":
        """Run `fn(engine)` on the loop thread before the next step."""
        future: Future[T] = Future()
        with self._queueing:
            if self._closed or not self.running:
                future.set_exception(LoopStopped(f"engine loop is not running ({self.fatal_error or 'stopped'})"))
            else:
                self._commands.put((fn, future, kind))
        return future

    def post(self, fn: Callable[[LLMEngine], object], kind: CommandKind = "other") -> None:
        """`submit` with nobody waiting for the result: a failure is logged, not lost (a stopped loop's
        refusal is no failure: whatever the command would free went with the engine)."""
        self.submit(fn, kind).add_done_callback(_log_failure)

    def call(self, fn: Callable[[LLMEngine], T], timeout: float | None = 60.0, kind: CommandKind = "other") -> T:
        """`submit` and wait. On timeout the command is withdrawn, so it never runs later; one that
        has already started is waited for (it runs between steps, so it ends soon)."""
        future = self.submit(fn, kind)
        try:
            return future.result(timeout)
        except FutureTimeout:
            if future.cancel():
                raise TimeoutError(f"engine loop did not run the command within {timeout} s") from None
            return future.result()

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to the output callback, as a step does: for a command that steps the engine
        itself (the start-up profile). A callback that raises ends the loop, as in a step: the
        requests whose outputs it dropped must not wait forever."""
        try:
            self._on_outputs(outputs)
        except BaseException as e:
            self._fail(e)
            raise

    def wait_progress(self, timeout: float) -> None:
        """Block until the loop's next pass (a step, a command batch, or an idle wait of at most
        `idle_wait_s`) or `timeout`: callers re-check their condition about every idle interval."""
        with self._progress:
            seen = self._generation
            self._progress.wait_for(lambda: self._generation != seen or not self.running, timeout)

    @property
    def busy(self) -> BusyTime:
        snapshot = BusyTime(**asdict(self._busy))
        snapshot.wall_s = time.perf_counter() - self._started_at if self._started_at else 0.0
        return snapshot

    # --- the loop thread ------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        idle = True
        try:
            while not self._stopping.is_set():
                self._run_commands(block=idle)
                if self._stopping.is_set():  # a command ended the loop (`deliver`), or `stop`: no step after it
                    break
                idle = not engine.has_unfinished_requests() or not self._step()
                self._notify_progress()
        except BaseException as e:  # noqa: BLE001 (anything that ends the loop must be reported)
            self._fail(e)
        finally:
            self._notify_progress()
            with self._queueing:
                self._closed = True
                self._fail_pending()

    def _step(self) -> bool:
        """One engine step and its callback; False when nothing could be scheduled."""
        t0 = time.perf_counter()
        outputs = self.engine.step()
        stats = self.engine.last_step
        if outputs:
            self._on_outputs(outputs)
        self._busy.forward_s += stats.forward_s
        self._busy.other_s += time.perf_counter() - t0 - stats.forward_s
        self._busy.steps += 1
        return stats.num_seqs > 0

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=self._idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, future, kind = item
            if future.set_running_or_notify_cancel():
                t0 = time.perf_counter()
                try:
                    future.set_result(fn(self.engine))
                except BaseException as e:  # noqa: BLE001 (the caller gets the error)
                    future.set_exception(e)
                spent = time.perf_counter() - t0
                if kind == "kv":
                    self._busy.kv_s += spent
                else:
                    self._busy.other_s += spent
            if self._stopping.is_set():  # the commands still queued are answered by `_fail_pending`
                return
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _notify_progress(self) -> None:
        with self._progress:
            self._generation += 1
            self._progress.notify_all()

    def _fail(self, error: BaseException) -> None:
        """End the loop (after the command under way, when called from one) and report why."""
        if self.fatal_error is not None:  # the first failure is the one reported
            return
        self.fatal_error = error
        self._stopping.set()
        log.error("engine loop failed; failing its requests", exc_info=error)
        if self._on_fatal is None:
            return
        try:
            self._on_fatal(error)
        except Exception:
            log.exception("reporting the engine loop's failure failed too")

    def _fail_pending(self) -> None:
        while True:
            try:
                _, future, _ = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(LoopStopped(f"engine loop stopped ({self.fatal_error or 'shutdown'})"))


def _log_failure(future: Future) -> None:
    error = None if future.cancelled() else future.exception()
    if error is not None and not isinstance(error, LoopStopped):
        log.error("engine command failed: %s: %s", type(error).__name__, error, exc_info=error)

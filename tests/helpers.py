"""Plain helpers for tests (importable because tests/ is on sys.path through conftest.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from pdserve.engine import LLMEngine, RequestOutput, SamplingParams


def run_all(engine: LLMEngine, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams],
            max_steps: int = 20_000) -> list[RequestOutput]:
    """Queue every prompt, step the engine until all finish (bounded), return outputs in order."""
    plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, plist)]
    return drain(engine, ids, max_steps)


def drain(engine: LLMEngine, ids: Sequence[str], max_steps: int = 20_000) -> list[RequestOutput]:
    done: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    else:
        raise AssertionError(f"engine did not finish within {max_steps} steps")
    return [done[i] for i in ids]


def assert_pool_idle(engine: LLMEngine) -> None:
    """No request holds a block: every block is free or a cached (evictable) prefix block."""
    assert not engine.requests, f"requests still tracked: {list(engine.requests)}"
    assert engine.pool.num_free == engine.pool.num_blocks, (
        f"{engine.pool.num_blocks - engine.pool.num_free} blocks still referenced"
    )


def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll `condition` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True

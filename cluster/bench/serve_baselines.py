"""Other servers to benchmark against, started and stopped as subprocesses on 127.0.0.1.

`transformers serve --continuous-batching` (transformers >= 5, extra `transformers[serving]`: FastAPI
+ uvicorn) serves an OpenAI-compatible API from one process; with continuous batching its requests
share a paged KV cache and a step loop, the closest like-for-like baseline to one pdserve engine.
How it is driven (read from transformers 5.23's `cli/serving/completion.py` and checked against it):

- Prompts: `/v1/completions` takes `prompt` as a string only (a list of token ids is a 400). The
  server tokenizes it with the model's tokenizer (special tokens added by the tokenizer's own rules;
  the project's presets add none). The benchmark therefore sends text whose tokenization is exactly
  the token ids sent to pdserve (see serve.roundtrip_prompt), so both see the same prompts.
- Output length: `max_tokens` sets `max_new_tokens`. EOS is switched off per request with the
  `generation_config` field (a JSON string that replaces the model's generation config) holding
  `eos_token_id: -1`: continuous batching stops a request on EOS only for ids >= 0. Every request
  then yields exactly `max_tokens` tokens (the final event's `usage.completion_tokens` says so).
  `do_sample: false` goes in the same field because the batching manager takes its sampling
  settings from the first request it sees.
- Streaming: one server-sent event per decoded text piece (about one per token; a token that decodes
  to no text yet sends none), then a final event with `finish_reason` and `usage`; no `[DONE]` line.
- Threads: the server sets none, so torch's intra-op pool follows OMP_NUM_THREADS, set here.
- KV cache: left to itself on a CPU, the batching manager takes 60% of the machine's RAM for its cache
  (13 GB here; ~15 s to allocate on the first request, and a big cache slows its steps), so the cache
  is sized explicitly: `--cb-num-blocks` blocks of 256 tokens (its default page size) holding
  `kv_cache_tokens`, and `--cb-max-batch-tokens` as the per-step token budget.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any


PAGE_SIZE = 256  # transformers' default tokens per cache page (ContinuousBatchingConfig.page_size)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TransformersServe:
    """`transformers serve --continuous-batching MODEL_DIR` as a subprocess; a context manager.

    Output goes to `log_path` (a pipe nobody reads would fill and block the server). `stop` always
    ends the process by its pid: terminate, wait, kill.
    """

    def __init__(self, model_dir: str | Path, *, threads: int = 2, kv_cache_tokens: int = 32768,
                 max_batch_tokens: int = 2048, log_path: Path | None = None, startup_timeout_s: float = 180.0,
                 log: Callable[[str], None] = print) -> None:
        self.model_dir = str(model_dir)
        self.kv_cache_tokens, self.max_batch_tokens = kv_cache_tokens, max_batch_tokens
        self.threads, self.startup_timeout_s = threads, startup_timeout_s
        self.log_path = log_path or Path(os.devnull)
        self.log = log
        self.base_url: str | None = None
        self._proc: subprocess.Popen | None = None

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "transformers.cli.transformers", "serve", self.model_dir,
               "--continuous-batching", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
               "--dtype", "float32", "--log-level", "warning",
               "--cb-num-blocks", str(math.ceil(self.kv_cache_tokens / PAGE_SIZE)),
               "--cb-max-batch-tokens", str(self.max_batch_tokens)]

    def request_fields(self) -> dict[str, Any]:
        """Body fields that make every completion greedy and exactly `max_tokens` long (module docstring)."""
        config = {"do_sample": False, "eos_token_id": -1}  # the body's max_tokens sets max_new_tokens
        return {"model": self.model_dir, "generation_config": json.dumps(config)}

    def start(self) -> str:
        port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads),
               "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1"}  # local model: no network
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self._proc = subprocess.Popen(self.command(port), stdout=out, stderr=subprocess.STDOUT, env=env,
                                          stdin=subprocess.DEVNULL)
        try:
            self._wait_healthy(f"http://127.0.0.1:{port}")
        except BaseException:
            self.stop()
            raise
        self.base_url = f"http://127.0.0.1:{port}"
        return self.base_url

    def _wait_healthy(self, url: str) -> None:
        t0 = time.monotonic()
        next_note = 10.0
        while True:
            elapsed = time.monotonic() - t0
            if self._proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited with code {self._proc.returncode} during start-up "
                                   f"(log: {self.log_path})")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.log(f"transformers serve (pid {self._proc.pid}) healthy on {url} after {elapsed:.1f} s")
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if elapsed > self.startup_timeout_s:
                raise TimeoutError(f"transformers serve not healthy after {self.startup_timeout_s:.0f} s "
                                   f"(log: {self.log_path})")
            if elapsed > next_note:
                self.log(f"  waiting for transformers serve ... {elapsed:.0f} s")
                next_note += 10.0
            time.sleep(0.5)

    def stop(self, grace_s: float = 10.0) -> None:
        proc, self._proc, self.base_url = self._proc, None, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> "TransformersServe":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

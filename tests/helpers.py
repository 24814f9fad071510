"""Plain helpers for tests (importable because tests/ is on sys.path through conftest.py)."""

from __future__ import annotations

import errno
import io
import random
import shutil
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForCausalLM, AutoModelForImageTextToText

from pdserve.engine import LLMEngine, RequestOutput, SamplingParams
from pdserve.engine.block_pool import KVPoolStatus
from pdserve.engine.cost_model import StepCost
from pdserve.engine.models.presets import PRESETS
from pdserve.kv_transfer.transports import tcp
from pdserve.wire import WorkerStatus


# Every family the engine is tested on: Llama, Qwen2 (with and without a window), Qwen3, Mistral
# (window shorter than the prompts), Gemma 2 and 3 (local/global layers; soft-capping), Phi-3, OLMo 2.
TEST_PRESETS = tuple(name for name in PRESETS if name.startswith("tiny-") and PRESETS[name].vision is None)
VISION_PRESETS = tuple(name for name in PRESETS if name.startswith("tiny-") and PRESETS[name].vision is not None)


class HFReference:
    """Greedy continuations from transformers' own `generate` (the ground truth), memoised."""

    def __init__(self, model_dir: Path) -> None:
        # eager: transformers' literal attention, the one every family supports (Gemma 2 has no SDPA path).
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
        self.model.eval()
        self.vocab_size = self.model.config.vocab_size
        self._memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._memo:
            out = self.model.generate(
                torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                do_sample=False, pad_token_id=0, eos_token_id=None,
            )
            self._memo[key] = out[0, len(prompt):].tolist()
        return self._memo[key]


class HFVisionReference:
    """Greedy continuations of prompts with images from transformers' own `generate`."""

    def __init__(self, model_dir: Path) -> None:
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
        self.image_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
        self.image_token_id = self.model.config.image_token_id

    @torch.inference_mode()
    def greedy(self, expanded_prompt: list[int], images: Sequence[bytes], max_new_tokens: int) -> list[int]:
        """`expanded_prompt`: every image's placeholder already repeated once per image token."""
        ids = torch.tensor([expanded_prompt])
        inputs: dict[str, torch.Tensor] = {}
        if images:
            pixels = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
            inputs = dict(self.image_processor(images=pixels, return_tensors="pt"))
            if "image_grid_thw" in inputs:  # M-RoPE: which tokens are image tokens
                inputs["mm_token_type_ids"] = (ids == self.image_token_id).int()
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs,
                                  max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                                  pad_token_id=0, eos_token_id=None)
        return out[0, len(expanded_prompt):].tolist()


def noise_png(seed: int, width: int, height: int) -> bytes:
    """A PNG of seeded random pixels."""
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def random_prompts(n: int, vocab_size: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts avoiding the special ids 0-2 (pad, bos, eos)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


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


_CLOSED_BY_PEER = (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN)


def write_then_read_to_end(sock: socket.socket, data: bytes) -> bytes:
    """Write `data`, end this side's writing, and read until the peer closes; the peer may close (or
    reset) the connection at any point of that, which ends the exchange as well."""
    answers = b""
    try:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        while chunk := sock.recv(1 << 16):
            answers += chunk
    except OSError as e:
        if e.errno not in _CLOSED_BY_PEER:
            raise
    return answers


def tcp_member(address: str, key: bytes) -> socket.socket:
    """A connection to a tcp KV receiver that proved membership as a sender's does, to write anything on after."""
    sock = socket.create_connection(tcp.split_address(address), timeout=10)
    nonce_r = tcp._read(sock, len(tcp.MAGIC) + tcp.NONCE_BYTES)[len(tcp.MAGIC):]
    nonce_s = bytes(range(tcp.NONCE_BYTES))
    sock.sendall(nonce_s + tcp._proof(key, b"sender", nonce_r, nonce_s))
    assert tcp._read(sock, 32) == tcp._proof(key, b"receiver", nonce_r, nonce_s)
    return sock


def worker_status(free_blocks: int = 1000, total_blocks: int = 1000, step_cost: StepCost = StepCost(),
                  **fields) -> WorkerStatus:
    """A live, profiled, idle worker's health report; `fields` override any of its fields."""
    report = {"worker_id": "w", "node_id": "n", "node_ip": "127.0.0.1", "model_digest": "", "alive": True,
              "fault": None, "profiled": True, "kv": KVPoolStatus(free_blocks, total_blocks, 0, 0, 0), "requests": 0,
              "transfers": 0, "step_cost": step_cost, "step_budget": 2048}
    return WorkerStatus(**{**report, **fields})


def hub_cache(home: Path, repo_id: str, model_dir: Path, revision: str = "0123456789abcdef" * 2 + "01234567") -> Path:
    """Make `home` an HF_HOME whose Hub cache holds `model_dir` as `repo_id` at `revision`, in the layout
    huggingface_hub documents (`hub/models--ORG--NAME/snapshots/REVISION/`, `refs/main` naming it).
    Returns the snapshot's directory."""
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot

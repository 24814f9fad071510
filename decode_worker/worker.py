"""The decode worker: takes KV handoffs into its pool and decodes in one continuous batch.

The receiving half of the KV-transfer protocol (`reserve`, `receive_layer`, `commit`,
`abort_transfer`) is exposed as actor methods (control plane and the `ray` data plane) and, with
the `grpc` transport, as a KVTransfer gRPC server. Tokens go to the router over pyzmq, one message
per request per step. `generate` runs a whole request here: the colocated mode, and the declared
fallback for prompts that are not worth a transfer.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from pdserve.engine import EngineConfig, LLMEngine, RequestOutput
from pdserve.engine.engine_loop import EngineLoop
from pdserve.engine.llm_engine import RequestHandoff
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.grpc_server import start_kv_server
from pdserve.kv_transfer.interface import Lease
from pdserve.kv_transfer.receiver import KVReceiver
from pdserve.wire import TokenSink, WorkRequest

LEASE_CHECK_S = 1.0


class DecodeWorker:
    def __init__(self, worker_id: str, model_dir: str, engine_config: dict, token_sink: str, transport: str,
                 lease_s: float = 30.0) -> None:
        self.worker_id = worker_id
        self.engine = LLMEngine(model_dir, EngineConfig(**engine_config))
        self.sink = TokenSink(token_sink)
        self.loop = EngineLoop(self.engine, self._on_outputs).start()
        self.receiver = KVReceiver(self.loop, lease_s=lease_s)
        self._kv_server, self.kv_address = start_kv_server(self.receiver) if transport == "grpc" else (None, None)
        self._started: dict[str, float] = {}  # request -> when decoding here began
        self._prefilling: dict[str, float] = {}  # colocated requests before their first token
        self._stop = threading.Event()
        self.step_log: deque[tuple[int, float]] = deque(maxlen=4096)  # (batch size, step seconds)
        threading.Thread(target=self._expire_leases, name="lease-expiry", daemon=True).start()

    def ping(self) -> dict:
        engine = self.engine
        return {"worker_id": self.worker_id, "free_blocks": engine.num_free_blocks,
                "total_blocks": engine.pool.num_blocks, "requests": len(engine.requests),
                "transfers": self.receiver.num_in_flight, "alive": self.loop.fatal_error is None}

    def stats(self) -> dict:
        return {"steps": list(self.step_log)}

    def get_kv_address(self) -> str | None:
        return self.kv_address

    # --- KV transfer, receiving side ------------------------------------------------------------
    def reserve(self, transfer_id: str, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                num_kv_tokens: int) -> Lease:
        return self.receiver.reserve(transfer_id, request_id, prompt_token_ids, params, num_kv_tokens)

    def receive_layer(self, transfer_id: str, layer: int, payload: np.ndarray, crc: int) -> None:
        self.receiver.receive_layer(transfer_id, layer, payload, crc)

    def commit(self, transfer_id: str, handoff: RequestHandoff) -> None:
        self._started[handoff.request_id] = time.time()
        self.receiver.commit(transfer_id, handoff)

    def abort_transfer(self, transfer_id: str, reason: str) -> bool:
        return self.receiver.abort(transfer_id, reason)

    # --- whole requests -------------------------------------------------------------------------
    def generate(self, work: WorkRequest) -> None:
        """Prefill and decode here (colocated mode). Raises ValueError for a request the engine refuses."""
        self._prefilling[work.request_id] = time.time()
        self.loop.call(lambda e: e.add_request(work.prompt_token_ids, work.params, work.request_id))

    def abort(self, request_id: str) -> bool:
        """Client went away: free whatever the request holds here (running, queued or mid-transfer)."""
        self._started.pop(request_id, None)
        self._prefilling.pop(request_id, None)
        in_transfer = self.receiver.abort_request(request_id, "aborted by the router")
        return self.loop.call(lambda e: e.abort_request(request_id)) or in_transfer

    def shutdown(self) -> None:
        self._stop.set()
        if self._kv_server is not None:
            self._kv_server.stop(grace=None)
        self.loop.stop()
        self.sink.close()

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        now = time.time()
        self.step_log.append((self.engine.last_step.num_seqs, self.engine.last_step.total_s))
        for out in outputs:
            events = {}
            prefill_start = self._prefilling.pop(out.request_id, None)
            if prefill_start is not None:  # colocated: this step produced the first token
                events = {"prefill_start": prefill_start, "prefill_end": now}
                self._started[out.request_id] = now
            if out.finished:
                events |= {"decode_start": self._started.pop(out.request_id, now), "decode_end": now}
            self.sink.send(out.request_id, out.new_token_ids, logprobs=out.logprobs[-1:] if out.logprobs else None,
                           finish_reason=out.finish_reason if out.finished else None,
                           text=out.text if out.finished else None, events=events,
                           cached_tokens=out.num_cached_tokens)

    def _expire_leases(self) -> None:
        while not self._stop.wait(LEASE_CHECK_S):
            self.receiver.expire_leases()

"""Open-loop load generation on asyncio: requests go out at their arrival times whatever the server does.

Arrivals are Poisson at a rate (seeded) or replayed from a trace's timestamps. Each request is one
task that sleeps until its arrival, streams, and timestamps every token on arrival, so thousands of
concurrent streams run from one process. Two clients sit behind one small interface (`StreamClient`):
pdserve's gRPC SDK, and OpenAI-compatible HTTP streaming (`/v1/completions`, server-sent events) to
drive other servers. Closed-loop tools wait for an answer before sending more, which hides queueing;
an open loop shows it.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

import pdserve
from pdserve.cluster.bench.serve_metrics import RequestRecord


@dataclass(frozen=True)
class Request:
    request_id: str
    token_ids: list[int]
    max_tokens: int
    text: str | None = None  # for servers that take text only; must tokenize back to token_ids


@dataclass(frozen=True)
class Delta:
    """What one streamed message carried: its new tokens and, when the server says, totals."""

    tokens: int
    total_tokens: int | None = None  # the server's own count of output tokens (final message)
    cached_tokens: int | None = None
    events: dict[str, float] | None = None  # the request's lifetime events, where the server sends them


class Rejected(Exception):
    """The server refused the request for load (gRPC RESOURCE_EXHAUSTED, HTTP 429)."""


class StreamClient(Protocol):
    """One connection to a server; entered inside the event loop that uses it."""

    async def __aenter__(self) -> "StreamClient": ...
    async def __aexit__(self, *exc: object) -> None: ...
    def stream(self, request: Request) -> AsyncIterator[Delta]: ...


# --- arrivals -------------------------------------------------------------------------------------
def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """`n` arrival offsets (s) of a Poisson process at `rate` req/s; the first request goes at 0."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def trace_arrivals(timestamps: Sequence[float], n: int | None = None, speedup: float = 1.0) -> list[float]:
    """Replay trace timestamps (s) as offsets from the first, `speedup` times faster (keeps burstiness)."""
    if speedup <= 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    ts = list(timestamps)[:n]
    return [(t - ts[0]) / speedup for t in ts]


# --- clients --------------------------------------------------------------------------------------
class GrpcClient:
    """pdserve's gRPC API through the SDK: greedy, exactly max_tokens tokens (ignore_eos)."""

    def __init__(self, address: str, timeout: float = 300.0) -> None:
        self.address, self.timeout = address, timeout
        self._client: pdserve.AsyncClient | None = None

    async def __aenter__(self) -> "GrpcClient":
        self._client = pdserve.AsyncClient(self.address, timeout=self.timeout)  # one channel, multiplexed
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def stream(self, request: Request) -> AsyncIterator[Delta]:
        assert self._client is not None, "enter the client first"
        try:
            async for chunk in self._client.generate_stream(
                    request.token_ids, temperature=0, max_tokens=request.max_tokens, ignore_eos=True,
                    request_id=request.request_id, timeout=self.timeout):
                first = chunk.prompt_tokens > 0  # only the first chunk carries the prompt's counts
                yield Delta(len(chunk.token_ids), cached_tokens=chunk.cached_tokens if first else None,
                            events=chunk.events)
        except pdserve.ResourceExhausted as e:
            raise Rejected(e.message) from None


class OpenAIClient:
    """OpenAI-compatible `/v1/completions` with `stream: true` over aiohttp.

    Sends `request.text` when set (servers that take text only) unless `prompt_ids`, else the token
    ids (vLLM, pdserve and others accept a list of ids as the prompt). Each event with text counts as
    one token's arrival, or with `event_per_token` each event with a choice (pdserve sends one per
    engine step, whose token may decode to no text yet); a final `usage.completion_tokens` is the
    server's own count. `extra_body` adds server-specific fields (e.g. vLLM's `ignore_eos`,
    transformers serve's `generation_config`).
    """

    def __init__(self, base_url: str, model: str = "", timeout: float = 300.0,
                 extra_body: dict[str, Any] | None = None, prompt_ids: bool = False,
                 event_per_token: bool = False) -> None:
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model, self.timeout = model, timeout
        self.extra_body = dict(extra_body or {})
        self.prompt_ids, self.event_per_token = prompt_ids, event_per_token
        self._session: Any = None

    async def __aenter__(self) -> "OpenAIClient":
        import aiohttp

        # limit=0: no cap on open connections; an open loop must not queue in the client.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                              timeout=aiohttp.ClientTimeout(total=self.timeout))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def stream(self, request: Request) -> AsyncIterator[Delta]:
        assert self._session is not None, "enter the client first"
        text_prompt = request.text is not None and not self.prompt_ids
        body = {"model": self.model, "prompt": request.text if text_prompt else request.token_ids,
                "max_tokens": request.max_tokens, "temperature": 0, "stream": True, **self.extra_body}
        async with self._session.post(self.url, json=body) as resp:
            if resp.status == 429:
                raise Rejected(await resp.text())
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:  # one line at a time
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"server error: {event['error']}")
                choices = event.get("choices") or []
                text = "".join(c.get("text") or "" for c in choices)
                usage = event.get("usage") or {}
                details = usage.get("prompt_tokens_details") or {}
                tokens = 1 if text or (self.event_per_token and choices) else 0
                if tokens or usage:
                    yield Delta(tokens, usage.get("completion_tokens"), details.get("cached_tokens"))


# --- the open loop --------------------------------------------------------------------------------
async def _one(client: StreamClient, req: Request, at: float, start: float, config: str, rate: float,
               bar: tqdm) -> RequestRecord:
    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    rec = RequestRecord(req.request_id, config, rate, send_time=time.perf_counter() - start,
                        prompt_len=len(req.token_ids), max_tokens=req.max_tokens)
    reported: int | None = None
    try:
        async for delta in client.stream(req):
            now = time.perf_counter() - start
            rec.token_times += [now] * delta.tokens
            reported = delta.total_tokens if delta.total_tokens is not None else reported
            rec.cached_tokens = delta.cached_tokens if delta.cached_tokens is not None else rec.cached_tokens
            rec.events = delta.events or rec.events
    except Rejected as e:
        rec.outcome, rec.error = "rejected", str(e)
    except Exception as e:  # noqa: BLE001 (every failure is recorded, and counts as a miss)
        rec.outcome, rec.error = "error", f"{type(e).__name__}: {e}"
    rec.end_time = time.perf_counter() - start
    rec.first_token_time = rec.token_times[0] if rec.token_times else None
    rec.output_tokens = max(len(rec.token_times), reported or 0)
    if rec.outcome == "ok" and not rec.token_times:
        rec.outcome, rec.error = "error", "stream ended without a token"
    bar.update(1)
    return rec


async def _run(client: StreamClient, requests: Sequence[Request], arrivals: Sequence[float], config: str,
               rate: float, progress: bool) -> list[RequestRecord]:
    # disable=None: tqdm draws only on a terminal (a log file gets no carriage-return noise).
    with tqdm(total=len(requests), desc=f"{config} @ {rate:.3g} req/s", unit="req", leave=False,
              disable=None if progress else True) as bar:
        async with client:
            start = time.perf_counter()
            return list(await asyncio.gather(*(
                _one(client, req, at, start, config, rate, bar) for req, at in zip(requests, arrivals))))


def run_load(client: StreamClient, requests: Sequence[Request], arrivals: Sequence[float], *, config: str,
             rate: float, progress: bool = True) -> list[RequestRecord]:
    """Send every request at its arrival offset (s) through `client`; one record per request."""
    if len(requests) != len(arrivals):
        raise ValueError(f"{len(requests)} requests but {len(arrivals)} arrival times")
    return asyncio.run(_run(client, requests, arrivals, config, rate, progress))


async def _run_sequential(client: StreamClient, requests: Sequence[Request], config: str,
                          progress: bool) -> list[RequestRecord]:
    with tqdm(total=len(requests), desc=f"{config} (one at a time)", unit="req", leave=False,
              disable=None if progress else True) as bar:
        async with client:
            start = time.perf_counter()
            return [await _one(client, req, 0.0, start, config, 0.0, bar) for req in requests]


def run_sequential(client: StreamClient, requests: Sequence[Request], *, config: str,
                   progress: bool = False) -> list[RequestRecord]:
    """One request at a time, each sent when the previous one ended (idle latencies, warm-up); rate 0."""
    return asyncio.run(_run_sequential(client, requests, config, progress))


def write_jsonl(records: Sequence[RequestRecord], path: Path, append: bool = True) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a" if append else "w") as f:
        for r in records:
            f.write(json.dumps(r.to_dict()) + "\n")


def read_jsonl(path: Path) -> list[RequestRecord]:
    return [RequestRecord.from_dict(json.loads(line)) for line in path.read_text().splitlines() if line]


"""The load generator: arrivals, trace loading and scaling, and both clients against real servers
(a tiny SSE server in the test, a real local pdserve cluster, and `transformers serve`)."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import random
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from aiohttp import web

from pdserve.cluster.bench.serve import (
    KV_TRANSFER_FAMILIES,
    METRIC_FAMILIES,
    METRICS_SETTLE_S,
    Scrape,
    ServeWorkload,
    metrics_check,
    roundtrip_prompt,
    scrape_metrics,
)
from pdserve.cluster.launcher import Cluster
from pdserve.cluster.manifest import load_manifest
from pdserve.cluster.bench.loadgen import (
    GrpcClient,
    OpenAIClient,
    Request,
    poisson_arrivals,
    read_jsonl,
    run_load,
    trace_arrivals,
    write_jsonl,
)
from pdserve.cluster.bench.serve_baselines import TransformersServe
from pdserve.cluster.bench.workload import (
    TraceRequest,
    block_prompts,
    find_trace,
    load_azure_trace,
    load_mooncake_trace,
    scale_requests,
)
from pdserve.engine.model_loader import load_tokenizer


# --- arrivals -------------------------------------------------------------------------------------
def test_poisson_arrivals_have_the_rate_and_are_seeded():
    a = poisson_arrivals(20000, rate=5.0, seed=3)
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert a[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(0.2, rel=0.05)  # exponential: sd = mean
    assert a == poisson_arrivals(20000, 5.0, seed=3) and a != poisson_arrivals(20000, 5.0, seed=4)
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0)


def test_trace_arrivals_keep_the_gaps_scaled():
    assert trace_arrivals([10.0, 11.0, 13.0, 17.0], n=3, speedup=2.0) == [0.0, 0.5, 1.5]


# --- traces ---------------------------------------------------------------------------------------
def test_azure_trace_arrivals_and_lengths(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                    "2023-11-16 18:15:50.9951690,3960,109\n2023-11-16 18:16:00.0000000,100,4000\n")
    reqs = load_azure_trace(path)
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 4.314579, 13.31941])
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(374, 44), (3960, 109), (100, 4000)]
    scaled = scale_requests(reqs, 0.25, 0.25, max_model_len=1024)
    assert [(r.prompt_len, r.output_len) for r in scaled] == [(94, 11), (990, 27), (25, 999)]
    assert all(r.prompt_len + r.output_len <= 1024 for r in scaled)
    capped = scale_requests(reqs, 0.25, 0.25, max_model_len=1024, max_output=64)
    assert [r.output_len for r in capped] == [11, 27, 64]


def test_a_long_answer_keeps_its_long_prompt_when_scaled_to_the_context():
    from pdserve.cluster.bench.workload import TraceRequest

    [scaled] = scale_requests([TraceRequest(0.0, 3000, 4000)], 0.25, 0.25, max_model_len=1024)
    assert (scaled.prompt_len, scaled.output_len) == (750, 274)
    with pytest.raises(ValueError, match="max_output 1 is below"):
        scale_requests([TraceRequest(0.0, 3000, 50)], 0.25, 0.25, max_model_len=1024, max_output=1)


AZURE_2023 = ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
              "2023-11-16 18:15:50.9951690,3960,109\n2023-11-16 18:16:00.0000000,100,4000\n")


@pytest.mark.parametrize("spelling", ["azure 2024", "burstgpt", "gzip", "out of order"])
def test_csv_traces_spelled_otherwise_load_as_azure_s_does(tmp_path, spelling):
    """Azure's 2024 timestamps (a zone), BurstGPT's columns (seconds, other names and order, a
    byte-order mark, a column more), gzip, rows out of order: the same requests as AZURE_2023's."""
    path = tmp_path / "trace.csv"
    if spelling == "azure 2024":
        path.write_text(" TIMESTAMP , ContextTokens,GeneratedTokens\n2023-11-16 20:15:46.68059+02:00,374,44\n"
                        "2023-11-16T18:15:50.995169Z,3960,109\n2023-11-16 18:16:00,100,4000\n")
    elif spelling == "burstgpt":
        path.write_text("\ufeffTimestamp,Model,Response tokens,Request tokens,Log Type\n"
                        "5.0,ChatGPT,44,374,Conversation log\n9.314579,ChatGPT,109,3960,Conversation log\n"
                        "18.31941,GPT-4,4000,100,Conversation log\n", encoding="utf-8")
    elif spelling == "gzip":
        path = tmp_path / "trace.csv.gz"
        path.write_bytes(gzip.compress(AZURE_2023.encode()))
    else:
        header, *rows = AZURE_2023.splitlines()
        path.write_text("\n".join([header, rows[2], rows[0], rows[1]]) + "\n")
    reqs = load_azure_trace(path)
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 4.314579, 13.31941])
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(374, 44), (3960, 109), (100, 4000)]
    assert len(load_azure_trace(path, 2)) == 2


def test_a_trace_s_times_without_a_zone_are_utc_not_this_machine_s(tmp_path, monkeypatch):
    path = tmp_path / "dst.csv"  # New York's clocks went from 02:00 to 03:00 that night
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-03-10 01:59:00,10,2\n2024-03-10 03:01:00,10,2\n")
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        assert [r.arrival_s for r in load_azure_trace(path)] == [0.0, 62 * 60.0]
    finally:
        monkeypatch.undo()
        time.tzset()


@pytest.mark.parametrize(("text", "message"), [
    ("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,374\n", r"trace.csv:2: no output value .*generatedtokens"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,374,44\n0.5,12.25,3\n",
     r"trace.csv:3: prompt length '12.25' is not a whole number"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,374,44\n", r"trace.csv:2: timestamp 'yesterday'"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "has no requests"),
])
def test_a_csv_row_that_does_not_parse_is_an_error_naming_its_line(tmp_path, text, message):
    path = tmp_path / "trace.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_azure_trace(path)


def test_mooncake_style_traces_give_their_block_length_and_may_lack_hash_ids(tmp_path):
    path = tmp_path / "blocks16.jsonl"
    rows = [{"timestamp": 20, "input_length": 31, "output_length": 4, "hash_ids": [7, 8]},
            {"timestamp": 0, "input_length": 32, "output_length": 4, "hash_ids": [7, 9]},
            {"timestamp": 10, "input_length": 5, "output_length": 4}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reqs = load_mooncake_trace(path)
    assert [(r.arrival_s, r.prompt_len, r.hash_ids) for r in reqs] == \
        [(0.0, 32, (7, 9)), (0.01, 5, ()), (0.02, 31, (7, 8))]
    assert {r.block_tokens for r in reqs} == {16}
    a, _, c = block_prompts(reqs, vocab_size=1000, seed=1)
    assert a[:16] == c[:16] and a[16:] != c[16:]  # one 16-token block shared, not 512
    assert load_mooncake_trace(path, block_tokens=8)[0].block_tokens == 8
    path.write_text('{"arrival_time": 2.5, "input_length": 3, "output_length": 1}\n'
                    '{"arrival_time": 1.0, "input_length": 3, "output_length": 1}\n')
    assert [r.arrival_s for r in load_mooncake_trace(path)] == [0.0, 1.5]  # seconds, as the name says
    path.write_text('{"timestamp": 0, "input_length": 3, "output_length": 1}\n{"timestamp": "soon"\n')
    with pytest.raises(ValueError, match=r"blocks16.jsonl:2: "):
        load_mooncake_trace(path)


def test_shared_traces_load_and_fit_the_model():
    conv = load_azure_trace(find_trace("azure2023_conv.csv"), 500)
    assert len(conv) == 500 and conv[0].arrival_s == 0.0
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(conv, conv[1:]))
    assert 2 < (len(conv) - 1) / conv[-1].arrival_s < 12  # the README's ~5.5 req/s
    code = load_azure_trace(find_trace("azure2023_code.csv"), 50)
    assert len(code) == 50
    assert load_mooncake_trace(find_trace("mooncake_synthetic_trace.jsonl"), 1)[0].block_tokens == 512
    moon = scale_requests(load_mooncake_trace(find_trace("mooncake_synthetic_trace.jsonl"), 300), 1 / 32, 1 / 4,
                          max_model_len=1024)
    assert all(r.prompt_len + r.output_len <= 1024 and r.block_tokens == 16 for r in moon)
    prompts = block_prompts(moon, vocab_size=8192, seed=1)
    by_first_block = {}
    for r, p in zip(moon, prompts):
        assert len(p) == r.prompt_len
        if r.hash_ids and r.prompt_len >= 16:
            by_first_block.setdefault(r.hash_ids[0], []).append(p[:16])
    shared = [blocks for blocks in by_first_block.values() if len(blocks) > 1]
    assert shared, "the trace's requests share prefixes"
    assert all(b == blocks[0] for blocks in shared for b in blocks)


def test_mooncake_equal_hash_ids_give_equal_token_blocks(tmp_path):
    path = tmp_path / "mooncake.jsonl"
    rows = [{"timestamp": 1000, "input_length": 1400, "output_length": 40, "hash_ids": [0, 1, 2]},
            {"timestamp": 1500, "input_length": 1536, "output_length": 4, "hash_ids": [0, 1, 5]},
            {"timestamp": 3000, "input_length": 600, "output_length": 9, "hash_ids": [5, 6]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reqs = scale_requests(load_mooncake_trace(path), 1 / 16, 1 / 4, max_model_len=1024)
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 2.0]
    assert [(r.prompt_len, r.output_len, r.block_tokens) for r in reqs] == [(88, 10, 32), (96, 2, 32), (38, 2, 32)]
    a, b, c = block_prompts(reqs, vocab_size=1000, seed=7)
    assert [len(p) for p in (a, b, c)] == [88, 96, 38]
    assert a[:64] == b[:64]            # hash ids 0, 1: the same two blocks
    assert a[64:88] != b[64:88]        # 2 vs 5
    assert b[64:96] == c[:32]          # hash id 5, at another position, is the same block
    assert (a, b, c) == tuple(block_prompts(reqs, vocab_size=1000, seed=7))
    assert a != block_prompts(reqs, vocab_size=1000, seed=8)[0]
    assert all(3 <= t < 1000 for p in (a, b, c) for t in p)
    # Scaling that cuts a prompt keeps its prefix, so shared blocks stay shared.
    tight = scale_requests(load_mooncake_trace(path), 1 / 16, 1 / 4, max_model_len=60)
    assert all(r.prompt_len + r.output_len <= 60 for r in tight)
    ta, tb, _ = block_prompts(tight, vocab_size=1000, seed=7)
    assert ta[:32] == tb[:32] == a[:32]


# --- the OpenAI-compatible client against a tiny SSE server ---------------------------------------
TOKENS = 5
GAP_S = 0.03


class SSEServer:
    """aiohttp.web on 127.0.0.1 in its own thread: streams TOKENS events GAP_S apart, then usage."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if body["prompt"] == "busy":
            return web.Response(status=429, text="overloaded")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["max_tokens"]):
            await asyncio.sleep(GAP_S)
            await resp.write(f'data: {json.dumps({"choices": [{"index": 0, "text": f"t{i}"}]})}\n\n'.encode())
        usage = {"completion_tokens": body["max_tokens"], "prompt_tokens": 3,
                 "prompt_tokens_details": {"cached_tokens": 2}}
        final = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": usage}
        await resp.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
        return resp

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    def __enter__(self) -> "SSEServer":
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_openai_client_records_every_token_arrival(tmp_path):
    with SSEServer() as server:
        client = OpenAIClient(f"http://127.0.0.1:{server.port}", model="m", extra_body={"ignore_eos": True})
        reqs = [Request("a", [5, 6, 7], TOKENS, text="hello"), Request("b", [8, 9], TOKENS),
                Request("c", [1], TOKENS, text="busy")]
        records = run_load(client, reqs, [0.0, 0.05, 0.1], config="sse", rate=20.0, progress=False)
    a, b, c = records
    for r in (a, b):
        assert r.outcome == "ok" and r.output_tokens == TOKENS == len(r.token_times)
        assert r.ttft >= GAP_S * 0.9 and r.cached_tokens == 2
        # One event per token, each stamped on arrival: the arrivals span the server's pacing (stamped all
        # at the end, they would not). Not each gap: a client thread the scheduler delays takes two at once.
        assert r.token_times[-1] - r.token_times[0] >= GAP_S * (TOKENS - 1) * 0.8
        assert r.end_time >= r.token_times[-1]
    # Sent on schedule: never before its arrival offset (less the event loop's clock resolution), and
    # without waiting for a (open loop: b went out while a was streaming). How late is not bounded: a
    # busy machine delays the client's thread by tens of milliseconds.
    assert b.send_time >= 0.05 - 0.005
    assert b.send_time < a.end_time
    assert c.outcome == "rejected" and "overloaded" in c.error and c.ttft is None
    sent = {body["prompt"] if isinstance(body["prompt"], str) else tuple(body["prompt"]) for body in server.bodies}
    assert sent == {"hello", (8, 9), "busy"}  # text when given, else the token ids
    assert all(body["stream"] and body["ignore_eos"] and body["max_tokens"] == TOKENS and body["temperature"] == 0
               for body in server.bodies)
    path = tmp_path / "r.jsonl"
    write_jsonl(records, path)
    assert read_jsonl(path) == records


# --- both pdserve clients against a real local cluster, checked against its /metrics ---------------
def tiny_manifest(model_dir):
    return load_manifest({
        "model": str(model_dir), "kv_memory_mb": 16, "max_model_len": 512,
        "server": {"address": "127.0.0.1:0", "http_address": "127.0.0.1:0"},
        "pools": {"prefill": {"num_cpus": 0.5}, "decode": {"num_cpus": 0.5}},
        "router": {"local_prefill_tokens": 0},  # every request takes the KV transfer path
    })


def test_grpc_and_http_clients_against_a_real_cluster_agree_with_its_metrics(model_dirs):
    rng = random.Random(0)
    reqs = [Request(f"g{i}", [rng.randrange(3, 1000) for _ in range(rng.randint(8, 60))], 6 + i) for i in range(6)]
    with Cluster(tiny_manifest(model_dirs["tiny-llama"]), log=lambda _: None) as cluster:
        url = f"http://{cluster.http_address}/metrics"
        http = OpenAIClient(f"http://{cluster.http_address}", model=cluster.manifest.served_name, timeout=60,
                            extra_body={"ignore_eos": True, "stream_options": {"include_usage": True}},
                            prompt_ids=True, event_per_token=True)
        runs = {}
        for api, client in (("grpc", GrpcClient(cluster.address, timeout=60)), ("http", http)):
            before = scrape_metrics(url)
            records = run_load(client, reqs, poisson_arrivals(len(reqs), 4.0, seed=1), config=api, rate=4.0,
                               progress=False)
            time.sleep(METRICS_SETTLE_S)
            runs[api] = records, metrics_check(before, scrape_metrics(url), records, api)
    # The gRPC run met a cold cache; the HTTP run sent the same prompts again, and the check says so.
    assert runs["grpc"][1]["cached_prompt_share"] == 0
    assert runs["http"][1]["cached_prompt_share"] > 0.5
    for api, (records, check) in runs.items():
        assert check["consistent"], (api, check)
        assert check["figures"]["completed"]["metrics"] == check["transfers"]["kv_transfers_ended"] == len(reqs)
        for req, r in zip(reqs, records):
            assert r.outcome == "ok", r.error
            assert r.output_tokens == req.max_tokens == len(r.token_times) == r.max_tokens, api
            assert r.prompt_len == len(req.token_ids)
            assert 0 < r.ttft <= r.e2e and r.tpot is not None
            assert r.token_times == sorted(r.token_times)
    for r in runs["grpc"][0]:  # the gRPC API sends each request's lifetime events with its last message
        e = r.events
        assert e["accepted"] <= e["prefill_start"] <= e["prefill_end"] <= e["decode_start"] <= e["finished"], e


def test_every_serve_run_draws_prompts_of_its_own(model_dirs):
    """The serve benchmark's runs share no prompt block (none can be served from another's prefix
    cache); a run's prompts keep the trace's lengths, survive decode/encode, and are the same for the
    same run (every configuration gets the same prompts at a rate)."""
    tokenizer = load_tokenizer(model_dirs["tiny-llama"])
    shapes = [TraceRequest(0.1 * i, n, 4 + i) for i, n in enumerate((16, 40, 33, 64))]
    workload = ServeWorkload(Path("trace.csv"), shapes, tokenizer, seed=0)
    runs = {tag: workload.requests(tag) for tag in ("warmup-disaggregated", "calibration", "rate-1", "rate-2")}
    assert workload.requests("rate-1") == runs["rate-1"]
    blocks = {tag: {tuple(r.token_ids[:16]) for r in reqs} for tag, reqs in runs.items()}
    for tag, reqs in runs.items():
        assert [(len(r.token_ids), r.max_tokens) for r in reqs] == [(s.prompt_len, s.output_len) for s in shapes]
        assert all(tokenizer(r.text)["input_ids"] == r.token_ids for r in reqs)
        assert len({r.request_id for r in reqs}) == len(reqs)
        assert not any(blocks[tag] & blocks[other] for other in runs if other != tag)


def test_a_colocated_cluster_s_metrics_are_complete_without_kv_transfer_families():
    """A colocated cluster has no KV senders: its scrape lacks their families and is still consistent;
    a disaggregated one's must have them, and the check names them when they are missing."""
    scrape = Scrape({f for f in METRIC_FAMILIES if f not in KV_TRANSFER_FAMILIES}, {})
    assert metrics_check(scrape, scrape, [], "grpc", kv_transfers=False)["consistent"]
    check = metrics_check(scrape, scrape, [], "grpc", kv_transfers=True)
    assert not check["consistent"] and check["missing_families"] == list(KV_TRANSFER_FAMILIES)


# --- transformers serve, through the same OpenAI client -------------------------------------------
def test_transformers_serve_gives_exact_lengths_for_roundtrip_prompts(model_dirs, tmp_path):
    model_dir = model_dirs["tiny-llama"]
    tokenizer = load_tokenizer(model_dir)
    rng = random.Random(0)
    ids = [roundtrip_prompt(tokenizer, n, rng) for n in (12, 40)]
    reqs = [Request(f"t{i}", p, 8 + i, text=tokenizer.decode(p)) for i, p in enumerate(ids)]
    with TransformersServe(model_dir, threads=1, log_path=tmp_path / "serve.log", log=lambda _: None) as server:
        client = OpenAIClient(server.base_url, model=str(model_dir), timeout=60, extra_body=server.request_fields())
        records = run_load(client, reqs, [0.0, 0.1], config="tf", rate=10.0, progress=False)
        # The server tokenizes the text into exactly the prompt's ids.
        body = {"prompt": reqs[1].text, "max_tokens": 2, **server.request_fields()}
        http = urllib.request.Request(server.base_url + "/v1/completions", json.dumps(body).encode(),
                                      {"Content-Type": "application/json"})
        with urllib.request.urlopen(http, timeout=60) as resp:
            usage = json.loads(resp.read())["usage"]
        pid = server._proc.pid
    assert usage == {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42}
    for req, r in zip(reqs, records):
        assert r.outcome == "ok", r.error
        assert r.output_tokens == req.max_tokens  # EOS switched off: exactly max_tokens
        assert 0 < len(r.token_times) <= req.max_tokens and r.ttft > 0
    with pytest.raises(OSError):  # stopped: the pid is gone
        os.kill(pid, 0)

"""End to end on a real local Ray cluster with a real gRPC server on loopback, through the SDK."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import urllib.request

import grpc
import pytest
import ray
from cluster_helpers import (assert_aborted, assert_idle, manifest, on_worker, record_engine_aborts, wait_clean_audit,
                             wait_for_lifetime_record, wait_until_idle)
from helpers import random_prompts, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from pdserve.client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
)
from pdserve.cluster.launcher import Cluster
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams

ARCH = "tiny-llama"
NEW_TOKENS = 10


# Two clusters decode speculatively, every draft verified (not sized by measured step times, so that
# drafts are sure to run): every behaviour here must hold with drafts verified as well. The
# disaggregated one drafts with both proposers, the target serving as its own draft model (its drafts
# are then what it decodes: a draft KV that went wrong would show as rejections).
@pytest.fixture(scope="module", params=[("disaggregated", "shm"), ("disaggregated", "tcp"), ("disaggregated", "gloo"),
                                        ("disaggregated", "grpc", "both"), ("colocated", "shm", "suffix")],
                ids=lambda p: "-".join(p))
def cluster(request, model_dirs):
    mode, transport, *method = request.param
    speculative = None
    if method:
        speculative = {"goodput_sizing": False, "method": method[0], "min_token_prob": 0.0}
        if method[0] == "both":  # short drafts: each draft token is a pass of the (target-sized) draft
            speculative.update(draft_model=str(model_dirs[ARCH]), max_draft_tokens=3)
    c = Cluster(manifest(model_dirs[ARCH], mode, transport, speculative=speculative), log=lambda _: None)
    c.start()
    yield c
    c.stop()


def test_concurrent_greedy_requests_match_generate(cluster, hf_reference):
    prompts = random_prompts(36, hf_reference[ARCH].vocab_size, 1, 300, seed=17)

    async def run_all():
        async with AsyncClient(cluster.address, timeout=120) as client:
            return await asyncio.gather(*(
                client.generate(p, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True) for p in prompts))

    results = asyncio.run(run_all())
    assert [r.token_ids for r in results] == [hf_reference[ARCH].greedy(p, NEW_TOKENS) for p in prompts]
    assert all(r.finish_reason == "length" and r.timings["e2e"] >= r.timings["ttft"] > 0 for r in results)
    if cluster.manifest.mode == "disaggregated":
        assert all(r.timings["kv_transfer"] > 0 for r in results)
    assert_idle(cluster)


def test_speculative_decoding_keeps_outputs_exact_and_reports_its_drafts(cluster, hf_reference):
    """A repeating prompt, whose continuation the model repeats too: the suffix proposer drafts it."""
    prompts = [[11, 12, 13, 14, 15, 16] * 6, random_prompts(1, hf_reference[ARCH].vocab_size, 40, 40, seed=5)[0]]
    with Client(cluster.address, timeout=60) as client:
        results = [client.generate(p, temperature=0, max_tokens=48, ignore_eos=True) for p in prompts]
        declined = client.generate(prompts[0], temperature=0, max_tokens=48, ignore_eos=True, speculative=False)
        picked = client.generate(prompts[1], temperature=0, max_tokens=48, ignore_eos=True, proposer="draft_model")
    assert [r.token_ids for r in results] == [hf_reference[ARCH].greedy(p, 48) for p in prompts]
    assert declined.token_ids == results[0].token_ids and declined.draft_tokens == 0
    assert picked.token_ids == results[1].token_ids
    if cluster.manifest.speculative is None:
        assert all(r.draft_tokens == r.accepted_draft_tokens == 0 for r in results)
    else:
        assert all(r.draft_tokens >= r.accepted_draft_tokens for r in results)
        assert results[0].accepted_draft_tokens > 0
        if cluster.manifest.speculative.method == "both":  # the random prompt, by the draft model alone
            assert_acceptance_as_colocated(cluster, prompts[1], picked)
            # the draft KV of every request that may draft came with the target's (sent by default): none
            # computed on the decode side; the one declining speculation took none
            counts = [s.receiver_counts for s in wait_until_idle(cluster) if s.receiver_counts]
            assert sum(c.get("draft_kv_arrived", 0) for c in counts) >= 3
            assert sum(c.get("draft_kv_declined", 0) for c in counts) >= 1
            assert not any(c.get("draft_kv_incomplete") for c in counts)
        with urllib.request.urlopen(f"http://{cluster.http_address}/metrics", timeout=10) as page:
            metrics = page.read().decode()
        accepted = re.findall(r'^pdserve_spec_accepted_draft_tokens_total\{worker="[^"]+"\} (\S+)$', metrics, re.M)
        assert sum(map(float, accepted)) >= results[0].accepted_draft_tokens
    assert_idle(cluster)


def assert_acceptance_as_colocated(cluster: Cluster, prompt: list[int], result) -> None:
    """The draft model accepted as much on the decode worker (its prompt KV sent by the prefill worker) as in one
    engine that prefills and decodes: the draft saw the same tokens (its drafts are whole and verified
    whole, not sized by measured times)."""
    m = cluster.manifest
    engine = LLMEngine(m.model, EngineConfig(**{**m.engine_config(m.pools.decode), "num_threads": None}))
    engine.add_request(prompt, SamplingParams.greedy(max_tokens=48, ignore_eos=True, proposer="draft_model"))
    local = [o for _ in range(200) if engine.has_unfinished_requests() for o in engine.step() if o.finished][0]
    assert local.token_ids == result.token_ids
    assert (result.draft_tokens, result.accepted_draft_tokens) == (local.num_draft_tokens, local.num_accepted_tokens)
    assert result.accepted_draft_tokens >= 0.9 * result.draft_tokens > 0


def test_streaming_text_and_tokens(cluster, hf_reference):
    with Client(cluster.address, timeout=60) as client:
        prompt = client.tokenize("The water was first")
        chunks = list(client.generate(prompt, stream=True, temperature=0, max_tokens=8, ignore_eos=True))
        full = client.generate(prompt, temperature=0, max_tokens=8, ignore_eos=True)
    assert [t for c in chunks for t in c.token_ids] == hf_reference[ARCH].greedy(prompt, 8) == full.token_ids
    assert "".join(c.text_delta for c in chunks) == full.text
    assert chunks[-1].finish_reason == "length" and chunks[-1].timings is not None
    assert all(c.finish_reason is None and c.token_ids for c in chunks[:-1])  # no empty chunk (the handoff notice)


def test_cancel_mid_stream_stops_the_request_and_frees_both_pools(cluster, caplog):
    for w in cluster.workers:
        on_worker(w, record_engine_aborts)
    with caplog.at_level(logging.INFO, logger="pdserve.lifetime"), Client(cluster.address, timeout=60) as client:
        stream = client.generate([7] * 50, stream=True, temperature=0, max_tokens=400, ignore_eos=True)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()  # cancels the RPC
        assert_aborted(cluster, caplog, "CANCELLED", 400)


def test_a_deadline_stops_the_request_and_frees_both_pools(cluster, caplog):
    for w in cluster.workers:
        on_worker(w, record_engine_aborts)
    with caplog.at_level(logging.INFO, logger="pdserve.lifetime"), Client(cluster.address) as client:
        # The deadline must fall while the request decodes (480 tokens take seconds, a quarter of one
        # decoded speculatively); on a busy machine the prompt pass and the handoff can outlast a short
        # one, so it doubles until one falls there.
        for timeout_s in (0.1, 0.2, 0.4, 0.8, 1.6, 3.2):
            caplog.clear()
            with pytest.raises(DeadlineExceeded):
                client.generate([9] * 30, timeout=timeout_s, temperature=0, max_tokens=480, ignore_eos=True)
            if wait_for_lifetime_record(caplog)["output_tokens"] > 0:
                break
            assert_idle(cluster)
        assert_aborted(cluster, caplog, "CANCELLED", 480)  # the server sees the call cancelled at its deadline


@pytest.mark.parametrize(
    ("prompt", "params", "error", "message"),
    [
        ("hello", {"temperature": -1.0}, InvalidArgument, "temperature must be a finite number >= 0"),
        ("hello", {"temperature": float("nan")}, InvalidArgument, "temperature must be a finite number"),
        ("hello", {"temperature": float("inf")}, InvalidArgument, "temperature must be a finite number"),
        ("hello", {"top_p": float("nan")}, InvalidArgument, "top_p must be in"),
        ("hello", {"top_p": float("-inf")}, InvalidArgument, "top_p must be in"),
        ("hello", {"top_p": 1.5}, InvalidArgument, "top_p must be in"),
        ("hello", {"top_k": 0, "max_tokens": 3, "stop": [""]}, InvalidArgument, "stop must be"),
        ("hello", {"proposer": "medusa"}, InvalidArgument, "proposer must be one of suffix, draft_model"),
        ("", {}, InvalidArgument, "prompt is empty"),
        ([5] * 600, {}, InvalidArgument, "context limit is 512"),
        ([5, 99999], {}, InvalidArgument, "token ids must be integers in"),
        ("hello", {"model": "gpt-9"}, NotFound, "unknown model 'gpt-9'"),
    ],
)
def test_bad_input_gets_a_clear_error(cluster, prompt, params, error, message):
    with Client(cluster.address, timeout=30) as client:
        with pytest.raises(error, match=message):
            client.generate(prompt, **params)
        assert len(client.generate("still serving", max_tokens=2, ignore_eos=True).token_ids) == 2


def test_model_info_health_and_reflection(cluster):
    with Client(cluster.address) as client:
        info = client.model_info()
    assert info.vocab_size == 1024 and info.max_model_len == 512 and info.mode == cluster.manifest.mode
    assert info.eos_token_id == 2 and list(info.eos_token_ids) == [2]  # the tiny presets' EOS
    with grpc.insecure_channel(cluster.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(cluster.address) as channel:
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert "pdserve.v1.PDServe" in services and "grpc.health.v1.Health" in services


def test_a_decode_worker_killed_mid_stream_costs_no_token_over_each_transport(cluster, hf_reference):
    """Failover over every KV transport: the decode worker dies (SIGKILL, by pid) mid-stream; Ray
    restarts it, the request is prefilled again and its KV sent to the new process over the same
    transport (a gloo group, a tcp connection, a shm channel made anew); the client sees every token
    once. Last of the module's tests on each cluster: it restarts a worker."""
    if cluster.manifest.mode != "disaggregated":
        pytest.skip("a colocated cluster has no KV transfer to fail over")
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 40, 40, seed=23)[0]
    decode = next(w for w in cluster.workers if w.pool == "decode")
    retries = cluster.router.stats.retries
    streamed = []
    with Client(cluster.address, timeout=120) as client:
        stream = client.generate(prompt, stream=True, temperature=0, max_tokens=400, ignore_eos=True)
        for chunk in stream:
            streamed += chunk.token_ids
            if len(streamed) >= 5:
                break
        os.kill(on_worker(decode, lambda self: os.getpid()), signal.SIGKILL)
        for chunk in stream:
            streamed += chunk.token_ids
    assert streamed == hf_reference[ARCH].greedy(prompt, 400)  # none repeated, none missing
    assert cluster.router.stats.retries > retries
    assert wait_until(lambda: all(w.healthy for w in cluster.workers), 90)
    wait_clean_audit(cluster)


@pytest.mark.parametrize("arch", ["tiny-qwen3", "tiny-gemma2"])
def test_new_families_through_a_disaggregated_cluster_match_generate(model_dirs, hf_reference, arch):
    """The equivalence matrix across the pools: concurrent prompts across block boundaries, prompts
    chunked by a 64-token step budget (and by the manifest's LAPS chunk of 24 tokens, or the short
    threshold where that is longer), shared prefixes hitting the prefill worker's cache; Gemma 2 also
    brings its 24-token windows and soft-capping through the KV handoff."""
    vocab = hf_reference[arch].vocab_size
    shared = random_prompts(1, vocab, 70, 70, seed=21)[0]
    with_prefix = [shared + tail for tail in random_prompts(4, vocab, 1, 30, seed=29)]
    prompts = random_prompts(12, vocab, 1, 300, seed=23) + with_prefix

    async def run(address):
        async with AsyncClient(address, timeout=120) as client:
            warm = await client.generate(shared, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            rest = await asyncio.gather(*(
                client.generate(p, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True) for p in prompts))
            return [warm, *rest]

    with Cluster(manifest(model_dirs[arch], "disaggregated", "tcp", max_num_batched_tokens=64,
                          router={"long_prompt_chunk_tokens": 24}), log=lambda _: None) as cluster:
        (prefill,) = [ray.get(w.handle.ping.remote()) for w in cluster.workers if w.pool == "prefill"]
        assert prefill.chunk_tokens == max(24, prefill.short_prompt_tokens)
        results = asyncio.run(run(cluster.address))
        assert [r.token_ids for r in results] == [hf_reference[arch].greedy(p, NEW_TOKENS)
                                                  for p in [shared, *prompts]]
        assert all(r.cached_tokens >= 64 for r in results[-len(with_prefix):])  # 4 shared blocks
        assert_idle(cluster)

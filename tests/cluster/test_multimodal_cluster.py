"""Vision-language models through a running cluster: images over gRPC (the SDK) and the OpenAI chat
API, encoded where the prompt pass runs or on an encode pool (their embeddings sent to the prompt
pass over the cluster's transport), their KV handed to decode over shm and tcp, outputs equal to
transformers' own; bad images refused by name while the cluster keeps serving; a decode worker
killed mid-stream loses no token (the request is encoded again where it resumes)."""

from __future__ import annotations

import base64
import json
import os
import signal
import urllib.error
import urllib.request

import pytest
import ray
from cluster_helpers import assert_idle, manifest, on_worker, wait_clean_audit
from helpers import noise_png, wait_until

from pdserve.client import Client, InvalidArgument
from pdserve.cluster.launcher import Cluster

NEW_TOKENS = 8
A, B = noise_png(11, 120, 90), noise_png(12, 64, 200)


# (family, mode, transport, where images are encoded); tests/cluster/test_encode_pool.py has an encode pool on
# tcp, and tests/kv_transfer/test_embeddings.py sends embeddings over every transport
@pytest.fixture(scope="module", params=[
    ("tiny-qwen2-vl", "disaggregated", "shm", "encode-pool"), ("tiny-qwen2-vl", "disaggregated", "tcp", "in-prefill"),
    ("tiny-llava", "disaggregated", "tcp", "in-prefill"), ("tiny-llava", "colocated", "shm", "encode-pool")],
    ids=lambda p: "-".join(p))
def cluster(request, vision_models):
    family, mode, transport, encoding = request.param
    spec = manifest(vision_models[family], mode, transport, server={"images": {"max_images": 3}})
    if encoding == "encode-pool":
        spec.pools.encode.replicas, spec.pools.encode.num_cpus = 1, 0.25
    if mode == "colocated":
        # One worker, so that a repeated prompt lands where its images' KV is cached: the router places by
        # the text before a prompt's first image only (the image blocks' hashes are the engine's), and these
        # prompts' first image comes before any full block of text.
        spec.pools.prefill.replicas = 0
    with Cluster(spec, log=lambda _: None) as c:
        c.family = family
        yield c


def expanded(cluster, client, text: str, images: list[bytes], vision_references,
             n: int = NEW_TOKENS) -> tuple[list[int], list[int]]:
    """The prompt's ids as the engine expands them, and transformers' greedy continuation of n tokens."""
    from pdserve.engine import EngineConfig, LLMEngine  # an in-process engine only to expand placeholders
    engine = LLMEngine(cluster.manifest.model, EngineConfig(kv_memory_bytes=4 * 2**20))
    ids = engine.prepare_images(client.tokenize(text), images).token_ids if images else client.tokenize(text)
    return ids, vision_references[cluster.family].greedy(ids, images, n)


def test_prompts_with_images_match_generate_through_the_pools(cluster, vision_references):
    with Client(cluster.address, timeout=120) as client:
        image = client.model_info().image_token
        assert image and client.model_info().max_images == 3
        cases = [(f"what is in {image} here", [A]), (f"{image} and {image}, compare", [A, B]), ("no image at all", [])]
        for text, images in cases:
            ids, want = expanded(cluster, client, text, images, vision_references)
            done = client.generate(text, images=images, temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            assert done.token_ids == want, text
            assert done.prompt_tokens == len(ids)
        again = client.generate(cases[1][0], images=cases[1][1], temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        assert again.cached_tokens > 0  # the same images: their KV came from the prefix cache
    if cluster.encoders:  # every request with images was encoded there, its embeddings sent over the transport
        assert cluster.router_stack.frontend.encoders.stats.fallbacks == 0
        received = [s.embedding_counts for s in ray.get([w.handle.ping.remote() for w in cluster.workers])]
        assert sum(c["embedding_frames"] for c in received) >= 3  # A, then A and B (the repeat may hit the cache)
        assert sum(c["embedding_corrupt_frames"] + c["embedding_refused_frames"] for c in received) == 0
    assert cluster.router.settings.image_tokens > 1  # placement counts an image as its tokens
    assert_idle(cluster)


def chat(cluster, messages: list[dict]) -> tuple[int, dict]:
    body = json.dumps({"messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://{cluster.http_address}/v1/chat/completions", body,
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def test_the_chat_api_takes_inline_images_and_refuses_remote_ones(cluster):
    if cluster.manifest.mode == "colocated" or cluster.manifest.kv_transfer.transport != "tcp":
        pytest.skip("the API layer is the same on every cluster")
    parts = [{"type": "text", "text": "what is this "}, {"type": "image_url", "image_url": {"url": data_url(A)}}]
    status, body = chat(cluster, [{"role": "user", "content": parts}])
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] > 16  # the image's tokens count
    remote = [{"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data"}}]
    status, body = chat(cluster, [{"role": "user", "content": remote}])
    assert status == 400 and "data: URL" in body["error"]["message"]
    status, body = chat(cluster, [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}])
    assert status == 400


def test_bad_images_get_invalid_argument_and_the_cluster_keeps_serving(cluster):
    if cluster.manifest.kv_transfer.transport not in ("shm",):
        pytest.skip("refusals are the router's and the prompt-pass worker's, the same on every transport")
    with Client(cluster.address, timeout=120) as client:
        image = client.model_info().image_token
        bad = {
            "truncated": (f"see {image}", [A[: len(A) // 3]]),
            "not an image": (f"see {image}", [b"GIF89a but not really"]),
            "too many": (image * 4, [A] * 4),
            "no placeholder": ("see nothing", [A]),
            "huge": (f"see {image}", [noise_png(1, 8, 8)[:16] + bytes(9 << 20)]),
        }
        for case, (text, images) in bad.items():
            with pytest.raises(InvalidArgument, match="image"):
                client.generate(text, images=images, max_tokens=2)
        assert client.generate(f"see {image}", images=[A], max_tokens=2).token_ids
    wait_clean_audit(cluster)


def test_a_decode_worker_killed_mid_stream_loses_no_token_of_a_request_with_images(cluster, vision_references):
    """Last on each cluster: it restarts a worker. The request resumes on the restarted worker from its
    images and the tokens sent (encoded again there), each token once."""
    if cluster.manifest.mode != "disaggregated" or cluster.manifest.kv_transfer.transport != "tcp":
        pytest.skip("failover of a request with images, once")
    decode = next(w for w in cluster.workers if w.pool == "decode")
    streamed = []
    with Client(cluster.address, timeout=120) as client:
        text = f"tell me about {client.model_info().image_token} in detail"
        _, want = expanded(cluster, client, text, [B], vision_references, 300)
        stream = client.generate(text, images=[B], stream=True, temperature=0, max_tokens=300, ignore_eos=True)
        for chunk in stream:
            streamed += chunk.token_ids
            if len(streamed) >= 5:
                break
        os.kill(on_worker(decode, lambda self: os.getpid()), signal.SIGKILL)
        for chunk in stream:
            streamed += chunk.token_ids
    assert streamed == want
    assert wait_until(lambda: all(w.healthy for w in cluster.workers), 90)
    wait_clean_audit(cluster)


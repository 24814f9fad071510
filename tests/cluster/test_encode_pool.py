"""The encode pool (EPD): a request's images are encoded on an encode worker, whose embeddings reach the
prefill worker and give transformers' own output; a repeated image is found in the encoder's cache;
text-only requests go on while images encode; an encode worker killed mid-request loses no request."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import urllib.request

import pytest
import ray
from cluster_helpers import assert_idle, install_gate, manifest, on_worker, open_gate, wait_clean_audit
from helpers import noise_png, wait_until

from pdserve.client import Client, InvalidArgument
from pdserve.cluster.launcher import Cluster
from pdserve.engine import EngineConfig, LLMEngine

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the injected functions travel by value
FAMILY = "tiny-qwen2-vl"
NEW_TOKENS = 8
A, B, C = noise_png(21, 150, 100), noise_png(22, 80, 80), noise_png(23, 60, 220)


@pytest.fixture(scope="module")
def cluster(vision_models):
    spec = manifest(vision_models[FAMILY], "disaggregated", "tcp")
    spec.pools.encode.replicas, spec.pools.encode.num_cpus = 2, 0.25
    with Cluster(spec, log=lambda _: None) as c:
        yield c


@pytest.fixture(scope="module")
def expand(cluster):
    """The prompt's ids with their placeholders expanded, as a worker's engine expands them."""
    engine = LLMEngine(cluster.manifest.model, EngineConfig(kv_memory_bytes=4 * 2**20))
    return lambda ids, images: engine.prepare_images(ids, images).token_ids


def encoder_counts(cluster) -> dict[str, tuple[int, int]]:
    """(images encoded, cache hits) of each encoder."""
    return {e.name: (s.images_encoded, s.cache_hits)
            for e, s in zip(cluster.encoders, ray.get([e.handle.ping.remote() for e in cluster.encoders]))}


def test_images_are_encoded_on_the_encode_pool_and_outputs_match_generate(cluster, expand, vision_references):
    with Client(cluster.address, timeout=120) as client:
        image = client.model_info().image_token
        before = encoder_counts(cluster)
        text = f"compare {image} with {image} please"
        ids = expand(client.tokenize(text), [A, B])
        done = client.generate(text, images=[A, B], temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        assert done.token_ids == vision_references[FAMILY].greedy(ids, [A, B], NEW_TOKENS)
        assert "encoded" in done.events and done.events["routed"] <= done.events["encoded"] <= done.events["prefill_start"]
        after = encoder_counts(cluster)
        assert sum(n for n, _ in after.values()) - sum(n for n, _ in before.values()) == 2
        # The same image again, in another prompt: the encoder that made it answers from its cache.
        again = client.generate(f"now {image} alone", images=[B], temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        assert again.token_ids == vision_references[FAMILY].greedy(expand(client.tokenize(f"now {image} alone"), [B]),
                                                                   [B], NEW_TOKENS)
        final = encoder_counts(cluster)
        assert sum(n for n, _ in final.values()) == sum(n for n, _ in after.values())  # nothing encoded twice
        assert sum(h for _, h in final.values()) == sum(h for _, h in after.values()) + 1
        # A header the router takes and a body the encoder cannot decode: refused by the encoder.
        with pytest.raises(InvalidArgument, match="image 0 is not a decodable"):
            client.generate(f"see {image}", images=[C[: len(C) // 3]], max_tokens=2)
    with urllib.request.urlopen(f"http://{cluster.http_address}/metrics", timeout=30) as response:
        metrics = response.read().decode()
    assert "pdserve_encode_images_total 4.0" in metrics and "pdserve_encode_fallbacks_total 0.0" in metrics
    with urllib.request.urlopen(f"http://{cluster.http_address}/health", timeout=30) as response:
        pools = {pool["name"]: pool for pool in json.loads(response.read())["pools"]}
    assert [w["name"] for w in pools["encode"]["workers"]] == ["encode-0", "encode-1"] and pools["encode"]["healthy"] == 2
    assert_idle(cluster)


def test_text_only_requests_go_on_while_images_encode(cluster):
    for encoder in cluster.encoders:
        on_worker(encoder, install_gate, "vision.encode_images")
    try:
        with Client(cluster.address, timeout=120) as client:
            image = client.model_info().image_token
            waiting: list = []
            thread = threading.Thread(target=lambda: waiting.append(client.generate(
                f"what is {image}", images=[C], temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)))
            thread.start()  # why a thread: the request waits at the gate
            text_only = client.generate("plain text while an image waits", temperature=0, max_tokens=NEW_TOKENS,
                                        ignore_eos=True)
            assert len(text_only.token_ids) == NEW_TOKENS and not waiting
            for encoder in cluster.encoders:
                on_worker(encoder, open_gate)
            thread.join(timeout=60)
            assert waiting and len(waiting[0].token_ids) == NEW_TOKENS
    finally:
        for encoder in cluster.encoders:
            on_worker(encoder, open_gate)
    assert_idle(cluster)


def test_encoders_that_hang_hold_no_request_past_the_timeout(cluster):
    """Every encoder stuck: each is given up at the timeout, and the prefill worker encodes instead."""
    pool = cluster.router_stack.frontend.encoders
    fallbacks, before = pool.stats.fallbacks, pool.timeout_s
    for encoder in cluster.encoders:
        on_worker(encoder, install_gate, "vision.encode_images")
    pool.timeout_s = 1.0
    try:
        with Client(cluster.address, timeout=120) as client:
            image = client.model_info().image_token
            done = client.generate(f"stuck {image} encoders", images=[noise_png(25, 90, 90)], temperature=0,
                                   max_tokens=NEW_TOKENS, ignore_eos=True)
            assert len(done.token_ids) == NEW_TOKENS and "encoded" not in done.events
            assert pool.stats.fallbacks == fallbacks + 1
    finally:
        pool.timeout_s = before
        for encoder in cluster.encoders:
            on_worker(encoder, open_gate)
        for encoder in pool.encoders:  # given up on: taken again as they answer (the next test's)
            encoder.failed_at = None
    assert_idle(cluster)


def break_tower(self) -> None:
    """Inside an encode worker: its tower raises on every image from now on (as on images it cannot take)."""
    def broken(images):
        raise MemoryError("the tower cannot take these images")

    self.test_tower, self.vision.encode_images = self.vision.encode_images, broken


def mend_tower(self) -> None:
    self.vision.encode_images = self.test_tower


def test_images_that_break_an_encoders_tower_go_to_the_prefill_worker_and_the_encoder_stays(cluster):
    pool = cluster.router_stack.frontend.encoders
    errors, faults, fallbacks = pool.stats.errors, pool.stats.faults, pool.stats.fallbacks
    for encoder in cluster.encoders:
        on_worker(encoder, break_tower)
    try:
        with Client(cluster.address, timeout=120) as client:
            image = client.model_info().image_token
            done = client.generate(f"a {image} too much", images=[noise_png(26, 70, 70)], temperature=0,
                                   max_tokens=NEW_TOKENS, ignore_eos=True)
            assert len(done.token_ids) == NEW_TOKENS and "encoded" not in done.events
    finally:
        for encoder in cluster.encoders:
            on_worker(encoder, mend_tower)
    # One encoder tried, not every one; none taken for failed.
    assert (pool.stats.errors, pool.stats.faults, pool.stats.fallbacks) == (errors + 1, faults, fallbacks + 1)
    assert all(e.failed_at is None for e in pool.encoders)
    assert_idle(cluster)


def test_an_encode_worker_killed_mid_request_loses_no_request(cluster, expand, vision_references):
    """The encoders hold the request's images at a gate; the one encoding them is killed (SIGKILL, by
    pid): the router tries the other, and the request completes with transformers' output. Ray
    restarts the killed one."""
    image_c_again = noise_png(24, 100, 100)  # never seen: no cache answers it
    pool = cluster.router_stack.frontend.encoders
    faults = pool.stats.faults
    for encoder in cluster.encoders:
        on_worker(encoder, install_gate, "vision.encode_images")
    pids = [on_worker(encoder, lambda self: os.getpid()) for encoder in cluster.encoders]
    with Client(cluster.address, timeout=120) as client:
        image = client.model_info().image_token
        text = f"describe {image} in words"
        done: list = []
        thread = threading.Thread(target=lambda: done.append(client.generate(
            text, images=[image_c_again], temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)))
        thread.start()  # why a thread: the request waits at the gate while its encoder is killed
        assert wait_until(lambda: any(e.outstanding for e in pool.encoders), 30)
        busy = next(i for i, e in enumerate(pool.encoders) if e.outstanding)
        os.kill(pids[busy], signal.SIGKILL)
        assert wait_until(lambda: pool.stats.faults > faults, 30)
        for i, encoder in enumerate(cluster.encoders):
            if i != busy:
                on_worker(encoder, open_gate)
        thread.join(timeout=60)
        assert done and done[0].token_ids == vision_references[FAMILY].greedy(
            expand(client.tokenize(text), [image_c_again]), [image_c_again], NEW_TOKENS)
    assert wait_until(lambda: _answers(cluster.encoders[busy]), 90)  # restarted by Ray
    wait_clean_audit(cluster)


def _answers(encoder) -> bool:
    try:
        ray.get(encoder.handle.ping.remote(), timeout=5)
        return True
    except Exception:
        return False


def test_an_encode_worker_killed_before_sending_embeddings_loses_no_request(cluster, expand, vision_references):
    """The encoder answered (the embeddings are made) and is killed while its send is held at a gate:
    the prompt-pass worker's transfer fails, it encodes the images itself, and the request completes
    with transformers' output."""
    fresh = noise_png(26, 70, 120)
    pool = cluster.router_stack.frontend.encoders
    answered = sum(pool.stats.per_encoder.values())
    for encoder in cluster.encoders:
        on_worker(encoder, install_gate, "sender.send")
    pids = {e.name: on_worker(e, lambda self: os.getpid()) for e in cluster.encoders}
    counts_before = dict(pool.stats.per_encoder)
    with Client(cluster.address, timeout=120) as client:
        text = f"what about {client.model_info().image_token} now"
        done: list = []
        thread = threading.Thread(target=lambda: done.append(client.generate(
            text, images=[fresh], temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)))
        thread.start()  # why a thread: the request waits on the gated send while its encoder is killed
        assert wait_until(lambda: sum(pool.stats.per_encoder.values()) > answered, 30)
        busy = next(name for name, n in pool.stats.per_encoder.items() if n > counts_before.get(name, 0))
        os.kill(pids[busy], signal.SIGKILL)
        for encoder in cluster.encoders:
            if encoder.name != busy:
                on_worker(encoder, open_gate)
        thread.join(timeout=90)
        assert done and "encoded" in done[0].events and done[0].token_ids == vision_references[FAMILY].greedy(
            expand(client.tokenize(text), [fresh]), [fresh], NEW_TOKENS)
    assert wait_until(lambda: _answers(next(e for e in cluster.encoders if e.name == busy)), 90)  # restarted by Ray
    wait_clean_audit(cluster)

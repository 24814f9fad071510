"""A cluster as a careful operator runs one: KV over `tcp` with mutual TLS and the cluster secret, a
layer-by-layer threshold below the context (a prompt past it streams its KV beside its pass, a shorter
one is sent when its pass ends), and the lossy codecs offered beside raw."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import ray
import trustme
from cluster_helpers import assert_idle, manifest, on_worker, worker
from helpers import random_prompts, wait_until

from pdserve.client import Client
from pdserve.cluster.launcher import Cluster

ARCH = "tiny-llama"
NEW_TOKENS = 8
LAYERWISE_MIN_TOKENS = 600  # the default (1,024) is the test model's whole context

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # functions run inside the workers


@pytest.fixture(scope="module")
def cluster(model_dirs, tmp_path_factory) -> Iterator[Cluster]:
    ca = trustme.CA()
    d = tmp_path_factory.mktemp("kv-tls")
    ca.cert_pem.write_to_path(d / "ca.pem")
    cert = ca.issue_cert("127.0.0.1")  # every worker presents it: all listen on loopback here
    cert.cert_chain_pems[0].write_to_path(d / "cert.pem")
    cert.private_key_pem.write_to_path(d / "key.pem")
    kv = {"transport": "tcp", "codec": ["raw", "int8", "fp8"], "layerwise_min_tokens": LAYERWISE_MIN_TOKENS,
          "tls": {"cert": str(d / "cert.pem"), "key": str(d / "key.pem"), "ca": str(d / "ca.pem")}}
    with Cluster(manifest(model_dirs[ARCH], kv_transfer=kv, max_model_len=1024, kv_memory_mb=32),
                 log=lambda _: None) as c:
        yield c


def transfers(cluster: Cluster) -> int:
    return on_worker(worker(cluster, "prefill"), lambda self: len(self.sender.transfer_log))


def transfer_after(cluster: Cluster, count: int) -> dict:
    """The prefill worker's record of the transfer after the first `count` (it writes it once the commit
    is answered, which may be after the client has its tokens)."""
    assert wait_until(lambda: transfers(cluster) > count, 10), "no transfer was recorded"
    return on_worker(worker(cluster, "prefill"), lambda self: self.sender.transfer_log[count])


def offer_first(self, codec: str) -> None:
    """On the prefill worker: offer `codec` before the others (the decode worker takes the first it can use)."""
    self.sender.codecs = {name: self.sender.codecs[name] for name in sorted(self.sender.codecs, key=lambda n: n != codec)}


@pytest.mark.parametrize("tokens", [LAYERWISE_MIN_TOKENS + 80, 300])
def test_prompts_cross_mutual_tls_exactly_layer_by_layer_past_the_threshold(cluster, hf_reference, tokens):
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, tokens, tokens, seed=tokens)[0]
    count = transfers(cluster)
    with Client(cluster.address, timeout=120) as client:
        out = client.generate(prompt, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    assert out.token_ids == hf_reference[ARCH].greedy(prompt, NEW_TOKENS)
    sent = transfer_after(cluster, count)
    assert sent["tokens"] == tokens and sent["codec"] == "raw" and not sent["recomputed"]
    assert sent["layerwise"] == (tokens >= LAYERWISE_MIN_TOKENS)
    metrics = on_worker(worker(cluster, "prefill"), lambda self: self.sender.metrics.exposition())
    assert 'transport="tcp"' in metrics
    assert_idle(cluster)


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_a_lossy_codec_carries_the_kv_in_fewer_bytes(cluster, hf_reference, codec):
    """Lossy: the tokens may differ from the exact ones, so what is checked is that the decode worker
    took the codec, the frames are smaller than raw's, and the request completes."""
    prefill = worker(cluster, "prefill")
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 400, 400, seed=["int8", "fp8"].index(codec) + 1)[0]
    with Client(cluster.address, timeout=120) as client:
        count = transfers(cluster)
        client.generate(prompt, max_tokens=2, temperature=0)  # raw, for the size to compare with (one token: no transfer)
        raw = transfer_after(cluster, count)
        on_worker(prefill, offer_first, codec)
        try:
            out = client.generate(prompt[::-1], max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
            sent = transfer_after(cluster, count + 1)
        finally:
            on_worker(prefill, offer_first, "raw")
    raw_bytes = raw["bytes"]
    assert raw["codec"] == "raw" and raw["tokens"] == sent["tokens"] == len(prompt)
    assert sent["codec"] == codec and len(out.token_ids) == NEW_TOKENS
    assert sent["bytes"] < raw_bytes * 0.6, (sent["bytes"], raw_bytes)  # 1 byte a value, and scales, against 4
    assert_idle(cluster)

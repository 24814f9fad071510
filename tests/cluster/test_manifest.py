"""Manifests are validated in full before anything starts; errors name the field."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cluster.manifest import DEFAULT_MANIFEST, CODECS, ManifestError, load_manifest
from pdserve.kv_transfer.codecs import CODEC_NAMES

ANY_FILE = str(DEFAULT_MANIFEST)  # a file that exists, where only a path's existence is checked


def test_default_manifest_is_valid():
    m = load_manifest()
    assert m.mode == "disaggregated" and m.kv_transfer.transport == "auto" and m.ray.address == "local"
    assert m.router.pool_policies == ("estimated_ttft", "estimated_ttft") and m.router.laps
    assert load_manifest(DEFAULT_MANIFEST) == m


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"pools": {"decode": {"replicas": -1}}}, "pools.decode.replicas: Input should be greater than or equal to 0"),
        ({"pools": {"prefill": {"num_gpus": -1}}}, "pools.prefill.num_gpus"),
        ({"pools": {"prefill": {"replicas": 0}}}, "disaggregated mode needs pools.prefill.replicas >= 1"),
        ({"modle": "llama-20m"}, "modle: Extra inputs are not permitted"),
        ({"mode": "fast"}, "mode: Input should be 'disaggregated' or 'colocated'"),
        ({"dtype": "int4"}, "dtype: Input should be"),
        ({"block_size": 0}, "block_size: Input should be greater than or equal to 1"),
        ({"kv_transfer": {"transport": "carrier-pigeon"}}, "kv_transfer.transport: Input should be 'auto', 'shm', 'tcp', 'grpc', 'gloo' or 'nccl'"),
        ({"kv_transfer": {"transport": "nccl"}, "pools": {"decode": {"num_gpus": 1}}}, "pools prefill need num_gpus >= 1"),
        ({"kv_transfer": {"transport": "nccl"}, "pools": {"prefill": {"num_gpus": 1}, "decode": {"num_gpus": 0.5}}},
         "pools decode need num_gpus >= 1"),
        ({"kv_transfer": {"transport": "nccl"}, "pools": {"prefill": {"num_gpus": 1}, "decode": {"num_gpus": 1},
                                                           "encode": {"replicas": 1}}},
         "pools encode need num_gpus >= 1"),  # its embeddings go over the same transport
        ({"router": {"policy": "random"}}, "router.policy"),
        ({"router": {"policy": "pdserve"}}, "router.policy: Value error, 'pdserve' is this policy's old name: it is "
                                            "now called 'estimated_ttft'"),
        ({"router": {"decode_policy": "pdserve"}}, "router.decode_policy: Value error, 'pdserve' is this policy's old "
                                                   "name: it is now called 'estimated_ttft'"),
        ({"kv_transfer": {"lease_s": float("nan")}}, "kv_transfer.lease_s: Input should be a finite number"),
        ({"kv_transfer": {"reserve_wait_s": float("inf")}}, "kv_transfer.reserve_wait_s: Input should be a finite"),
        ({"pools": {"decode": {"num_cpus": float("inf")}}}, "pools.decode.num_cpus: Input should be a finite"),
        ({"router": {"max_queued_prefills": 0}}, "router.max_queued_prefills: Input should be greater than"),
        ({"server": {"address": "localhost"}}, "server.address: Value error, must be HOST:PORT"),
        ({"server": {"http_address": "0.0.0.0:99999"}}, "server.http_address: Value error, must be HOST:PORT"),
        ({"server": {"address": "127.0.0.1:9000", "http_address": "127.0.0.1:9000"}}, "address and http_address must differ"),
        ({"server": {"tls_cert": "/nonexistent.pem"}}, "tls_cert and tls_key must be given together"),
        ({"server": {"tls_cert": "/nonexistent.pem", "tls_key": "/nonexistent.key"}}, "does not exist"),
        ({"pools": {"decode": {"resources": {"decode": "lots"}}}}, "pools.decode.resources.decode"),
        ({"kv_transfer": {"transport": "gloo", "tls": {"cert": ANY_FILE, "key": ANY_FILE, "ca": ANY_FILE}}},
         "tls secures the tcp and grpc transports only"),
        ({"kv_transfer": {"tls": {"cert": "/nonexistent.pem", "key": ANY_FILE, "ca": ANY_FILE}}},
         "kv_transfer.tls: /nonexistent.pem does not exist"),
        ({"kv_transfer": {"codec": "zstd"}}, "kv_transfer.codec: Value error, unknown codec 'zstd': codecs are raw, "
                                             "int8, fp8, cachegen"),
        ({"kv_transfer": {"codec": ["int8", "fp16", "RAW"]}}, "unknown codec 'fp16', 'RAW'"),
        ({"kv_transfer": {"codec": []}}, "offer at least one codec"),
        ({"pools": {"decode": {"resources": {"GPU": 1}}}}, "'GPU' is Ray's own resource: set num_cpus / num_gpus"),
        ({"pools": {"prefill": {"resources": {"prefill": -1}}}}, "prefill: -1.0 is not an amount Ray places"),
        ({"pools": {"prefill": {"resources": {"prefill": 1.5}}}}, "prefill: 1.5 is not an amount Ray places"),
        ({"pools": {"prefill": {"resources": {"prefill": 0.00001}}}}, "is not an amount Ray places"),
        ({"dtype": "float16"}, "dtype float16 runs on GPUs only, and workers prefill-0, decode-1 have num_gpus 0"),
        ({"model_path_shared": True}, "model_path_shared needs the model directory's absolute path"),
        ({"server": {"auth_token": ""}}, "server.auth_token: Value error, is empty, which would let every client in"),
        ({"server": {"max_request_bytes": 100}}, "server.max_request_bytes: Input should be greater than or equal to"),
        ({"speculative": {"method": "medusa"}},
         "speculative.method: Input should be 'suffix', 'draft_model' or 'both'"),
        ({"speculative": {"method": "both"}}, "speculative: Value error, speculative method 'both' needs draft_model"),
        ({"speculative": {"max_draft_tokens": 0}}, "speculative.max_draft_tokens: Input should be greater than"),
        ({"speculative": {"min_token_prob": 2}}, "speculative.min_token_prob: Input should be less than"),
    ],
)
def test_invalid_manifests_name_the_field(data, message):
    with pytest.raises(ManifestError, match=re.escape(message)):
        load_manifest(data)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"kv_transfer": {"lease_s": 5, "commit_timeout_s": 8}},
         "kv_transfer: Value error, commit_timeout_s (8 s) exceeds the prefill side's lease (lease_s + 2 s = 7 s)"),
        ({"supervision": {"restart_backoff_s": 40}},
         "supervision: Value error, restart_backoff_s (40 s) exceeds restart_backoff_max_s (30 s)"),
        ({"supervision": {"restart_backoff_max_s": 600}},
         "supervision: Value error, restart_backoff_max_s (600 s) exceeds restart_window_s (300 s)"),
        ({"kv_transfer": {"lease_s": 1}},
         "(top level): Value error, a hung worker is taken for healthy up to 3 s (misses_to_fail x (ping_timeout_s + "
         "ping_interval_s)), not less than the prefill side's KV lease (3 s)"),
        ({"supervision": {"ping_timeout_s": 20}}, "a hung worker is taken for healthy up to 41 s"),
        ({"supervision": {"ping_interval_s": 0}}, "supervision.ping_interval_s: Input should be greater than 0"),
    ],
)
def test_timings_out_of_order_are_refused_naming_both(data, message):
    with pytest.raises(ManifestError) as e:
        load_manifest(data)
    assert message in str(e.value)


def test_the_deadlines_derive_from_the_manifest():
    d = load_manifest({"kv_transfer": {"lease_s": 12, "reserve_wait_s": 4},
                       "supervision": {"ping_interval_s": 0.25, "restart_backoff_s": 0.5}}).deadlines
    assert (d.kv.lease_s, d.kv.reserve_wait_s, d.kv.commit_timeout_s) == (12, 4, 12)  # a commit: the lease, unless set
    assert (d.kv.sender_lease_s, d.kv.reservation_bound_s, d.kv.lease_check_s) == (14, 14, 0.5)
    assert (d.health.ping_interval_s, d.health.restart_backoff_s, d.health.hung_after_s) == (0.25, 0.5, 2.5)
    assert d.leak_after_s == 19
    quick = load_manifest({"kv_transfer": {"reserve_wait_s": 1, "reserve_answer_margin_s": 0.5}}).deadlines
    assert quick.kv.reservation_bound_s == 1.5


def test_speculative_settings_reach_every_engine_and_are_off_unless_asked_for():
    from pdserve.engine.speculative.config import SpeculativeConfig

    m = load_manifest({"speculative": {"max_draft_tokens": 4}})
    assert m.engine_config(m.pools.decode)["speculative"] == SpeculativeConfig(max_draft_tokens=4)
    default = load_manifest({})
    assert default.speculative is None and default.engine_config(default.pools.decode)["speculative"] is None


def test_the_manifest_offers_the_codecs_there_are():
    assert CODECS == CODEC_NAMES
    m = load_manifest({"kv_transfer": {"codec": ["cachegen", "int8"], "tls": {"cert": ANY_FILE, "key": ANY_FILE,
                                                                          "ca": ANY_FILE}}})
    assert m.kv_transfer.codecs == ("cachegen", "int8") and m.kv_transfer.tls.cert.is_absolute()
    # Joining a cluster, the files are the workers' to have: the head node may not hold them.
    remote = load_manifest({"ray": {"address": "auto"}, "kv_transfer": {"tls": {"cert": "kv.pem", "key": "/k.pem",
                                                                               "ca": "/ca.pem"}}})
    assert remote.kv_transfer.tls.cert == Path.cwd() / "kv.pem"


def test_yaml_problems(tmp_path):
    with pytest.raises(ManifestError, match="does not exist"):
        load_manifest(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ManifestError, match="not valid YAML"):
        load_manifest(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ManifestError, match="top level must be a mapping"):
        load_manifest(bad)


def test_up_rejects_a_bad_manifest_before_starting_anything(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: disaggregated\npools:\n  decode:\n    replicas: many\n")
    result = subprocess.run([sys.executable, "-m", "pdserve.cluster.cli", "up", str(bad)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert "pools.decode.replicas" in result.stderr and "preparing model" not in result.stdout


def test_the_auth_token_never_shows_where_a_manifest_is_printed_or_stored():
    m = load_manifest({"server": {"auth_token": "s3cret-token-value"}})
    assert m.server.token == "s3cret-token-value"  # for what sends or checks it
    for shown in (repr(m), str(m), m.model_dump_json(), json.dumps(m.model_dump(mode="json"))):
        assert "s3cret-token-value" not in shown and "**********" in shown

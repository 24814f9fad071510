"""`pdserve up`'s overrides of a manifest's common settings: each one's effect on the manifest, the
command line that gives them, errors that name the option, and the served-model name they may set.
No cluster is started: overrides act on the manifest before anything runs."""

from __future__ import annotations

import pytest

from pdserve.cluster.cli import build_parser
from pdserve.cluster.manifest import DEFAULT_MANIFEST, ManifestError, load_manifest
from pdserve.cluster.overrides import OVERRIDES, ManifestOverrides

BASE = {"model": "tiny-llama", "pools": {"prefill": {"replicas": 1, "num_cpus": 0.5}, "decode": {"replicas": 1}},
        "server": {"address": "127.0.0.1:50051", "http_address": "127.0.0.1:8000"}}


@pytest.mark.parametrize(("overrides", "read", "expected"), [
    ({"model": "tiny-qwen2"}, lambda m: m.model, "tiny-qwen2"),
    ({"served_model_name": "team-model"}, lambda m: m.served_name, "team-model"),
    ({"mode": "colocated"}, lambda m: m.mode, "colocated"),
    ({"prefill_replicas": 3}, lambda m: m.pools.prefill.replicas, 3),
    ({"decode_replicas": 4}, lambda m: m.pools.decode.replicas, 4),
    ({"grpc_address": "0.0.0.0:6000"}, lambda m: m.server.address, "0.0.0.0:6000"),
    ({"http_address": "0.0.0.0:9000"}, lambda m: m.server.http_address, "0.0.0.0:9000"),
    ({"log_level": "debug"}, lambda m: m.log_level, "debug"),
])
def test_each_override_sets_its_field_and_leaves_the_rest(overrides, read, expected):
    plain = load_manifest(BASE)
    overridden = load_manifest(BASE, ManifestOverrides(**overrides))
    assert read(plain) != expected and read(overridden) == expected
    field = OVERRIDES[next(iter(overrides))].field
    assert without(overridden.model_dump(), field) == without(plain.model_dump(), field)


def without(dump: dict, field: tuple[str, ...]) -> dict:
    """A manifest's dump less the field at `field`'s path."""
    *parents, leaf = field
    target = dump
    for part in parents:
        target = target[part]
    del target[leaf]
    return dump


def test_overrides_fill_sections_the_manifest_leaves_out_and_change_no_data():
    data = {"model": "tiny-llama"}
    m = load_manifest(data, ManifestOverrides(decode_replicas=2, http_address="127.0.0.1:0"))
    assert (m.pools.decode.replicas, m.server.http_address) == (2, "127.0.0.1:0")
    assert data == {"model": "tiny-llama"}
    on_default = load_manifest(None, ManifestOverrides(prefill_replicas=2))
    assert on_default.pools.prefill.replicas == 2
    assert on_default.model == load_manifest(DEFAULT_MANIFEST).model


@pytest.mark.parametrize(("overrides", "message"), [
    ({"decode_replicas": -1}, "pools.decode.replicas (set by --decode-replicas): Input should be greater than or "
                              "equal to 0"),
    ({"mode": "fast"}, "mode (set by --mode): Input should be 'disaggregated' or 'colocated'"),
    ({"served_model_name": ""}, "served_model_name (set by --served-model-name): String should have at least 1"),
    ({"prefill_replicas": 0}, "disaggregated mode needs pools.prefill.replicas >= 1"),
    ({"log_level": "loud"}, "log_level (set by --log-level): Input should be 'debug', 'info', 'warning' or 'error'"),
])
def test_a_bad_override_is_refused_naming_its_option(overrides, message):
    with pytest.raises(ManifestError, match="is invalid") as e:
        load_manifest(BASE, ManifestOverrides(**overrides))
    assert message in str(e.value)


def test_the_command_line_gives_every_override():
    args = build_parser().parse_args([
        "up", "my.yaml", "--model", "Qwen/Qwen2.5-0.5B", "--served-model-name", "qwen", "--mode", "colocated",
        "--prefill-replicas", "2", "--decode-replicas", "3", "--grpc-address", "0.0.0.0:6000",
        "--http-address", "0.0.0.0:9000", "--log-level", "info"])
    assert args.manifest == "my.yaml"
    assert ManifestOverrides.from_args(args) == ManifestOverrides(
        model="Qwen/Qwen2.5-0.5B", served_model_name="qwen", mode="colocated", prefill_replicas=2,
        decode_replicas=3, grpc_address="0.0.0.0:6000", http_address="0.0.0.0:9000",
        log_level="info")
    assert ManifestOverrides.from_args(build_parser().parse_args(["up"])) == ManifestOverrides()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--decode-replicas", "many"])


def test_the_served_name_is_the_model_s_own_name_never_a_whole_path(tmp_path):
    model_dir = tmp_path / "models" / "my-llama"
    model_dir.mkdir(parents=True)
    assert load_manifest({"model": str(model_dir)}).served_name == "my-llama"
    assert load_manifest({"model": "tiny-llama"}).served_name == "tiny-llama"
    assert load_manifest({"model": "Qwen/Qwen2.5-0.5B"}).served_name == "Qwen/Qwen2.5-0.5B"
    assert load_manifest({"model": str(model_dir), "served_model_name": "x"}).served_name == "x"

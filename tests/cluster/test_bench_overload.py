"""`pdserve bench overload` (the one benchmark that runs a manifest of the user's, and writes it into its
results) on a cluster with an auth token, in a run of two requests: its client sends the token, and
the results file does not hold it."""

from __future__ import annotations

import json

import yaml

from pdserve.cluster.bench.overload import OverloadConfig, run
from pdserve.cluster.bench.report import publish
from pdserve.engine.models.presets import make_model

TOKEN = "overload-s3cret-token"


def test_the_results_file_holds_no_secret(tmp_path):
    model = make_model("tiny-llama", tmp_path / "tiny-llama", seed=0)
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(yaml.safe_dump({
        "model": str(model), "mode": "colocated", "kv_memory_mb": 16, "max_model_len": 256,
        "pools": {"prefill": {"replicas": 0}, "decode": {"num_cpus": 0.5}}, "server": {"auth_token": TOKEN}}))
    out = tmp_path / "overload.json"
    result = run(OverloadConfig(manifest=str(manifest), num_requests=2, burst_s=0.1, max_tokens=4, reference_sample=1,
                                out=out))
    assert result["outcomes"] == {"ok": 2}  # the token went with every request
    written = out.read_text()
    assert TOKEN not in written
    assert json.loads(written)["manifest"]["server"]["auth_token"] == "**********"
    # Its section of the docs page, from the results as written: no secret there either.
    page = tmp_path / "benchmarks.md"
    publish(page, "overload", json.loads(written))
    text = page.read_text()
    assert "## Overload" in text and "| completed | 2 (" in text and "every pool fully free afterwards | yes" in text
    assert TOKEN not in text

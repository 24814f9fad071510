"""`pdserve bench epd`, run small: the same image-heavy requests against an encode pool and against
encoding in the prefill worker, every request answered, and its section of the docs."""

from __future__ import annotations

import json

from plan_helpers import vision_profile

from pdserve.cluster.bench.epd import EPDBenchConfig, run
from pdserve.cluster.bench.report import key_of, publish


def test_the_epd_benchmark_serves_both_deployments_and_writes_its_section(tmp_path, vision_models):
    out = tmp_path / "epd.json"
    profile = vision_profile()  # a synthetic one: the predictions' table is made, whatever its figures
    profile.save(tmp_path / "profile.json")
    cfg = EPDBenchConfig(model=str(vision_models["tiny-qwen2-vl"]), num_requests=8, rate=8.0, popular_share=0.5,
                         popular_images=1, max_tokens=4, deployments=("epd", "encode-in-prefill"), out=out,
                         profile=tmp_path / "profile.json")
    result = run(cfg, log=lambda _: None)
    rows = result["rows"]
    assert set(rows) == {"epd", "encode-in-prefill"}
    assert all(r["errors"] == 0 and r["completed"] == 8 for r in rows.values())
    assert rows["epd"]["images_encoded"] + rows["epd"]["cache_hits"] > 0
    assert "cache_hit_rate" not in rows["encode-in-prefill"]
    page = tmp_path / "benchmarks.md"
    publish(page, key_of(json.loads(out.read_text())), json.loads(out.read_text()))
    text = page.read_text()
    assert "encode pool" in text.lower() and "| epd |" in text and "text-only TTFT p90" in text
    predicted = result["predicted"]
    assert set(predicted) == {"epd", "encode-in-prefill"} and all(p["completed"] == 8 for p in predicted.values())
    # the synthetic image pass (160 ms) holds the prefill worker's loop only where images are encoded there
    assert predicted["epd"]["ttft_p90_s_text_only"] < predicted["encode-in-prefill"]["ttft_p90_s_text_only"]
    assert "simulator's prediction" in text

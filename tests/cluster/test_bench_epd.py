"""`pdserve bench epd`, run small: the same image-heavy requests against an encode pool and against
encoding in the prefill worker, every request answered, and its section of the docs."""

from __future__ import annotations

import json

from pdserve.cluster.bench.epd import EPDBenchConfig, run
from pdserve.cluster.bench.report import key_of, publish


def test_the_epd_benchmark_serves_both_deployments_and_writes_its_section(tmp_path, vision_models):
    out = tmp_path / "epd.json"
    cfg = EPDBenchConfig(model=str(vision_models["tiny-qwen2-vl"]), num_requests=8, rate=8.0, popular_share=0.5,
                         popular_images=1, max_tokens=4, deployments=("epd", "encode-in-prefill"), out=out)
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

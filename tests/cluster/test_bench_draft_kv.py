"""`pdserve bench draft-kv`, run small: the prompt pass with and without the draft's beside it, the
draft's prompt pass alone and its KV through the transports, and its section of the docs."""

from __future__ import annotations

import json

from pdserve.cluster.bench.draft_kv import DraftKVBenchConfig, run
from pdserve.cluster.bench.report import key_of, publish


def test_the_draft_kv_benchmark_times_recomputing_and_sending_and_writes_its_section(tmp_path, model_dirs,
                                                                                    tiny_llama_draft):
    target, draft = model_dirs["tiny-llama"], tiny_llama_draft
    out = tmp_path / "draft-kv.json"
    result = run(DraftKVBenchConfig(model=str(target), draft_model=str(draft), prompt_tokens=(64, 200),
                                    transports=("tcp",), repeats=2, out=out), log=lambda _: None)
    assert [r["tokens"] for r in result["rows"]] == [64, 200]
    assert all(r["recompute_s"] > 0 and r["target_kv_bytes"] == 2 * r["draft_kv_bytes"] for r in result["rows"])
    assert all(r["prefill_with_draft_s"] > 0 and r["prefill_s"] > 0 for r in result["rows"])
    assert {(s["transport"], s["tokens"]) for s in result["sends"]} == {("tcp", 64), ("tcp", 200)}
    assert all(s["bytes"] == r["draft_kv_bytes"] for s, r in zip(result["sends"], result["rows"]))
    page = tmp_path / "benchmarks.md"
    results = json.loads(out.read_text())
    publish(page, key_of(results), results)
    text = page.read_text()
    assert "the draft model's prompt KV" in text and "| 200 |" in text and "sent by tcp (ms)" in text
    assert "with the draft's (ms)" in text

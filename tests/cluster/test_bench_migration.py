"""`pdserve bench migration`, run small: streams moved with their KV and by recompute, their pauses
beside a decode step and the KV's transfer time, and its section of the docs."""

from __future__ import annotations

import json

from pdserve.cluster.bench.migration import MigrationBenchConfig, run
from pdserve.cluster.bench.report import key_of, publish


def test_the_migration_benchmark_moves_streams_both_ways_and_writes_its_section(tmp_path, model_dirs):
    out = tmp_path / "migration.json"
    # 32 tokens after the move's start: with 8, a loaded machine once let a request end before its move
    # reached the worker ("it is not decoding").
    result = run(MigrationBenchConfig(model=str(model_dirs["tiny-llama"]), contexts=(64, 160), repeats=2,
                                      tokens_before=8, tokens_after=32, out=out), log=lambda _: None)
    assert [r["context"] for r in result["rows"]] == [64, 160]
    for row in result["rows"]:
        ways = [r["way"] for r in row["runs"]]
        assert ways.count("moved") == ways.count("recomputed") == 2
        moved = [r for r in row["runs"] if r["way"] == "moved"]
        # the KV of every token in context but the last (sampled, its KV not yet computed) moved
        assert all(r["kv_tokens"] >= row["context"] - 1 and r["kv_bytes"] > 0 for r in moved)
        assert all(r["pause_s"] > 0 and r["step_s"] > 0 for r in row["runs"])
        assert row["transfer_s"] > 0 and row["target_s"] > row["transfer_s"]
    page = tmp_path / "benchmarks.md"
    publish(page, key_of(json.loads(out.read_text())), json.loads(out.read_text()))
    text = page.read_text()
    assert "Live migration" in text and "| 160 |" in text and "recomputed p50 (ms)" in text

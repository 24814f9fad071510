"""`pdserve bench spec`, run small: off and speculative side by side, and its section of the docs."""

from __future__ import annotations

import json

from pdserve.cluster.bench.report import key_of, publish
from pdserve.cluster.bench.spec import PromptPool, SpecBenchConfig, markdown, run

SYSTEMS = {"off", "suffix", "draft", "both"}


def test_the_spec_benchmark_measures_every_proposer_on_fresh_prompts_and_writes_its_section(tmp_path, model_dirs,
                                                                                          tiny_llama_draft):
    target, draft = model_dirs["tiny-llama"], tiny_llama_draft
    out = tmp_path / "spec.json"
    lines: list[str] = []
    result = run(SpecBenchConfig(model=str(target), draft_model=str(draft), batches=(1, 2), repeats=1, prompt_len=48,
                                 output_len=12, open_loop_requests=4, max_runs=2, start_rate=50.0, out=out), log=lines.append)
    for workload in ("code", "conversation", "sampled"):
        for batch in (1, 2):
            runs = result.runs[workload][batch]
            assert set(runs) == SYSTEMS and all(len(r) == 1 for r in runs.values())
            assert all(r.drafted == r.accepted == 0 for r in runs["off"])
            assert all(r.tpot_ms > 0 and r.output_tps > 0 and r.decode_steps > 0 for rs in runs.values() for r in rs)
    for figures in result.open_loop.values():  # each system searched, for both objectives
        assert set(figures.goodput) == SYSTEMS and set(figures.objectives) == {"tight", "loose"}
        assert figures.idle_ttft_s > 0 and figures.idle_tpot_s > 0
        # the goodput target checked directly: each system run at 0.97x off's goodput, off too
        checked = {name for name, rate in figures.goodput["off"].items() if rate}
        assert {s: set(shares) for s, shares in figures.at_target.items()} == {s: checked for s in SYSTEMS}
        assert all(0 <= share <= 1 for shares in figures.at_target.values() for share in shares.values())
    assert any(shares for figures in result.open_loop.values() for shares in figures.at_target.values())
    assert any("open loop" in line for line in lines)
    page = tmp_path / "benchmarks.md"
    results = json.loads(out.read_text())
    publish(page, key_of(results), results)
    text = page.read_text()
    assert "## Speculative decoding" in text and "| code | 1 |" in text and "| conversation | 2 |" in text
    assert "TPOT at batch 1 on code" in text and "the outputs of off and suffix, draft, both were identical" in text
    assert "| sampled | tight:" in text and "| goodput off (req/s) |" in text and "met at 0.97× off's" in text
    assert "or as many as off's did there), closest: suffix" in text
    for figures in results["open_loop"].values():  # a results file from before the check at one rate
        del figures["at_target"]
    assert "Goodput with speculation ≥ 0.97× without on every workload and objective, lowest:" in markdown(results)


def test_a_workload_whose_prompts_run_out_hands_them_out_again_and_says_so():
    pool = PromptPool([[1], [2], [3]])
    assert pool.take(2) == [[1], [2]] and not pool.reused
    assert pool.take(2) == [[3], [1]] and pool.reused
    assert pool.for_rate(1.0, 2) == pool.for_rate(1.0, 2) == [[2], [3]]  # one rate: the same prompts for all

"""`pdserve bench replanning`, run small: a shifting trace calibrated on the simulator, every static split
and the online planner served on fresh clusters, goodput per phase, and its section of the docs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from plan_helpers import synthetic_profile

from pdserve.cluster import cli
from pdserve.cluster.bench.replanning import PHASES, ReplanBenchConfig, run
from pdserve.cluster.bench.report import key_of, publish
from pdserve.engine.cost_model import StepCost
from pdserve.engine.model_store import model_digest


def test_the_replanning_benchmark_serves_every_split_and_the_planner_and_writes_its_section(tmp_path, model_dirs):
    model = model_dirs["tiny-llama"]
    profile = replace(synthetic_profile(StepCost(0.002, 0.0002, 0.0), decode_s=0.004),
                      model_digest=model_digest(model), max_model_len=1024)
    profile.save(tmp_path / "profile.json")
    out = tmp_path / "replanning.json"
    result = run(ReplanBenchConfig(profile=tmp_path / "profile.json", model=str(model), phase_s=2, load=0.5,
                                   ttft_slo_s=2.0, tpot_slo_s=0.2, interval_s=1, window_s=3, calibration_runs=3,
                                   max_model_len=512,
                                   out=out), log=lambda _: None)
    assert [r["name"] for r in result["runs"]] == ["static 1P+2D", "static 2P+1D", "online planner"]
    requests = sum(p["requests"] for p in result["phases"].values())
    for r in result["runs"]:
        assert len(r["records"]) == requests and all(rec["outcome"] == "ok" for rec in r["records"])
        assert set(r["goodput"]) == {*PHASES, "whole trace"} and r["goodput"]["whole trace"] > 0
    assert all(p["rate"] > 0 and set(p["predicted"]) == {"1P+2D", "2P+1D"} for p in result["phases"].values())
    online = result["runs"][-1]  # every role change it made is listed, each naming the split it left
    assert len(online["role_changes"]) >= abs(int(online["final"][0]) - int(online["start"][0]))
    assert all("; split " in change for change in online["role_changes"])
    page = tmp_path / "benchmarks.md"
    publish(page, key_of(json.loads(out.read_text())), json.loads(out.read_text()))
    text = page.read_text()
    assert "online planner against static splits" in text.lower() and "| static 2P+1D |" in text


def test_the_calibration_needs_a_run_and_a_phase_no_split_carries_is_a_clear_error(tmp_path, model_dirs, capsys):
    """Refused before any cluster starts: no calibration run at all, and objectives no split meets at any
    rate the calibration tried (its one run, at 1 request/s)."""
    with pytest.raises(SystemExit) as refused:
        cli.main(["bench", "replanning", "--profile", str(tmp_path / "p.json"), "--calibration-runs", "0"])
    assert refused.value.code == 2 and "must be 1 or more, not 0" in capsys.readouterr().err
    model = model_dirs["tiny-llama"]
    profile = replace(synthetic_profile(StepCost(0.002, 0.0002, 0.0), decode_s=0.004), model_digest=model_digest(model),
                      max_model_len=1024)
    profile.save(tmp_path / "p.json")
    with pytest.raises(ValueError, match="no split met the objectives on conversation, summarisation, code completion "
                                         "at any rate the calibration tried \\(simulated runs per split and phase: 1\\)"):
        run(ReplanBenchConfig(profile=tmp_path / "p.json", model=str(model), ttft_slo_s=0.001, calibration_runs=1,
                              max_model_len=512, out=tmp_path / "out.json"), log=lambda _: None)
    assert not (tmp_path / "out.json").exists()

"""Speculative decoding in the profile and the cluster simulator: what a profile measures of it on a real
engine, how simulated drafts turn acceptance into tokens per step, what a draft model's prompt KV costs
either way, and the errors that say what is missing."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import pytest
from plan_helpers import synthetic_profile
from test_plan import manifest

from pdserve.cluster.manifest import DEFAULT_MANIFEST
from pdserve.cluster.plan.costs import DraftPassCost, HardwareProfile, SpeculationCosts
from pdserve.cluster.plan.profiler import profile_speculation
from pdserve.cluster.plan.sim_speculation import Drafting
from pdserve.cluster.plan.simulator import ClusterSimulator, SimRequest, unique_prompt
from pdserve.engine.cost_model import StepCost
from pdserve.engine.speculative.config import SpeculativeConfig
from pdserve.engine.speculative.sizing import DecodeCost, DraftCandidate, draft_lengths

PREFILL = StepCost(0.002, 1e-5, 0.0)
DECODE_S = 0.010  # the synthetic profile's decode step, whatever the batch
# A verifying step: its premium and each draft token's cost small beside the step's fixed cost, as on a CPU.
VERIFY = DecodeCost(a=0.010, b=0.0002, verify=0.001)
DRAFT_PASS = DraftPassCost(0.001, 0.0001, 0.00001)


def speculating_profile(draft_model: str | None = None) -> HardwareProfile:
    model_based = draft_model is not None
    costs = SpeculationCosts(VERIFY, draft_model, DRAFT_PASS if model_based else None,
                             StepCost(0.004, 3e-5, 0.0) if model_based else None)
    profile = synthetic_profile(PREFILL, decode_s=DECODE_S)
    profile.workers = {t: replace(w, speculation=costs) for t, w in profile.workers.items()}
    return profile


def speculative(method: str = "suffix", **changes) -> dict:
    return {"method": method, "draft_model": None if method == "suffix" else "pystd-llama-draft", **changes}


def one_at_a_time(n: int, prompt_len: int, output_len: int, gap_s: float) -> list[SimRequest]:
    return [SimRequest(i * gap_s, unique_prompt(i + 1, prompt_len), output_len) for i in range(n)]


def tpot(records) -> float:
    return statistics.median(r.tpot for r in records)


def test_a_profile_with_speculation_round_trips_through_its_file(tmp_path):
    for draft_model in (None, "pystd-llama-draft"):
        profile = speculating_profile(draft_model)
        profile.save(tmp_path / "p.json")
        assert HardwareProfile.load(tmp_path / "p.json") == profile


def test_simulated_drafts_give_the_tokens_per_step_their_acceptance_does_at_the_verify_steps_cost():
    one = {"mode": "colocated", "pools": {"prefill": {"replicas": 0}, "decode": {"replicas": 1}}}
    m = manifest(**one, speculative=speculative())
    requests = one_at_a_time(4, 64, 600, gap_s=100.0)  # each alone: a batch of one
    off = ClusterSimulator(manifest(**one), speculating_profile()).run(requests).records
    never = ClusterSimulator(m, speculating_profile(), drafting=Drafting(0.0)).run(requests).records
    assert [r.tpot for r in never] == [r.tpot for r in off]  # nothing worth verifying: the plain steps

    alpha = 0.7
    spec = ClusterSimulator(m, speculating_profile(), drafting=Drafting(alpha), seed=3).run(requests).records
    assert all(r.output_tokens == 600 for r in spec)
    # What one step of one sequence verifies and gains in expectation, by the engine's own sizing.
    context = 64 + 300
    (k,) = draft_lengths([DraftCandidate(context, [alpha ** j for j in range(1, 9)], alpha)], VERIFY)
    assert 1 <= k <= 8
    scale = speculating_profile().workers[1].speculation.decode_scale([context], [k])
    expected_tpot = DECODE_S * scale / (1 + sum(alpha ** j for j in range(1, k + 1)))
    assert tpot(spec) == pytest.approx(expected_tpot, rel=0.1)
    assert tpot(spec) < 0.7 * tpot(off)

    # Drafts offered on half the steps, two tokens long on average (one or three): the tokens a step gives.
    sparse = ClusterSimulator(m, speculating_profile(), drafting=Drafting(alpha, share=0.5, length=2.0),
                              seed=4).run(requests).records
    costs = speculating_profile().workers[1].speculation
    step_s = DECODE_S * (0.5 + 0.25 * costs.decode_scale([context], [1]) + 0.25 * costs.decode_scale([context], [3]))
    tokens = 1 + 0.25 * alpha + 0.25 * (alpha + alpha ** 2 + alpha ** 3)
    assert tpot(sparse) == pytest.approx(step_s / tokens, rel=0.1)


def test_a_runs_drafting_is_read_from_its_counts():
    # 10 verifications, 4 ending on a rejected token, 24 of 30 draft tokens accepted, over 40 decode steps
    # (3 of the drafts the draft model's)
    d = Drafting.measured(accepted=24, verifications=10, rejected=4, drafted=30, decode_steps=40, model_verifications=3)
    assert (d.acceptance, d.share, d.length, d.model_share) == (24 / 28, 0.25, 3.0, 0.3)
    assert Drafting.measured(accepted=0, verifications=0, rejected=0, drafted=0, decode_steps=40,
                             model_verifications=0) is None


def test_a_draft_model_drafts_only_where_its_passes_pay():
    one = {"mode": "colocated", "pools": {"prefill": {"replicas": 0}, "decode": {"replicas": 1}}}
    m = manifest(**one, speculative=speculative("draft_model"))
    requests = one_at_a_time(2, 64, 200, gap_s=100.0)
    cheap = ClusterSimulator(m, speculating_profile("pystd-llama-draft"), drafting=Drafting(0.8)).run(requests).records
    dear = speculating_profile("pystd-llama-draft")
    dear.workers[1] = replace(dear.workers[1], speculation=replace(dear.workers[1].speculation,
                                                                   draft_pass=DraftPassCost(0.02, 0.0, 0.0)))
    priced_out = ClusterSimulator(m, dear, drafting=Drafting(0.8)).run(requests).records
    off = ClusterSimulator(manifest(**one), dear).run(requests).records
    assert tpot(cheap) < 0.8 * tpot(off)
    assert [r.tpot for r in priced_out] == [r.tpot for r in off]  # a pass dearer than a step: never drafts


def test_both_pays_the_draft_models_passes_only_for_its_drafts():
    one = {"mode": "colocated", "pools": {"prefill": {"replicas": 0}, "decode": {"replicas": 1}}}
    requests = one_at_a_time(2, 64, 300, gap_s=100.0)
    profile = speculating_profile("pystd-llama-draft")

    def run(method: str, model_share: float):
        drafting = Drafting(0.8, share=0.6, length=3.0, model_share=model_share)
        return tpot(ClusterSimulator(manifest(**one, speculative=speculative(method)), profile, drafting=drafting,
                                     seed=5).run(requests).records)

    # the same draws: with none of its drafts the model's, `both` costs what the suffix proposer does
    assert run("both", 0.0) == run("suffix", 0.0)
    assert run("suffix", 0.0) < run("both", 0.5) < run("both", 1.0)


def test_a_draft_models_prompt_kv_lengthens_the_prompt_pass_when_sent_and_the_first_decode_step_when_not():
    def run(draft_kv: str):
        m = manifest(speculative=speculative("draft_model", draft_kv=draft_kv))
        return ClusterSimulator(m, speculating_profile("pystd-llama-draft"), drafting=Drafting(0.8)).run(
            one_at_a_time(3, 1024, 40, gap_s=50.0)).records

    sent, recomputed = run("send"), run("recompute")
    # the prompt pass with the draft's beside it: 0.004 + 3e-5·1024 s against 0.002 + 1e-5·1024 s alone
    gained = statistics.median(a.ttft - b.ttft for a, b in zip(sent, recomputed))
    assert gained == pytest.approx((0.004 + 3e-5 * 1024) - (0.002 + 1e-5 * 1024), rel=0.05)
    # the decode worker's draft catches up over the prompt on the first drafting step instead
    catch_up = DRAFT_PASS.seconds(1, 1024)
    spent = statistics.median((b.end_time - b.first_token_time) - (a.end_time - a.first_token_time)
                              for a, b in zip(sent, recomputed))
    assert spent == pytest.approx(catch_up, rel=0.25)


def test_what_the_simulator_lacks_for_speculation_is_named():
    m = manifest(speculative=speculative())
    with pytest.raises(ValueError, match="measured without speculation.*pdserve profile"):
        ClusterSimulator(m, synthetic_profile(PREFILL), drafting=Drafting(0.5))
    with pytest.raises(ValueError, match="without a draft model.*pdserve profile"):
        ClusterSimulator(manifest(speculative=speculative("both")), speculating_profile(), drafting=Drafting(0.5))
    # a profile with a draft model's costs serves the model-free proposer too
    ClusterSimulator(m, speculating_profile("pystd-llama-draft"), drafting=Drafting(0.5))
    with pytest.raises(ValueError, match="--acceptance"):
        ClusterSimulator(m, speculating_profile())
    with pytest.raises(ValueError, match="chance in"):
        Drafting(1.5)


@pytest.mark.parametrize("method", ["suffix", "draft_model"])
def test_the_profiler_measures_what_speculation_adds_on_a_real_engine(model_dirs, tiny_llama_draft, method):
    spec = SpeculativeConfig(method=method, draft_model=None if method == "suffix" else str(tiny_llama_draft),
                             max_draft_tokens=8)
    config = {"dtype": "float32", "block_size": 16, "kv_memory_bytes": 32 * 2**20, "max_model_len": 1024,
              "max_num_seqs": 64, "max_num_batched_tokens": 512, "device": "cpu", "speculative": spec}
    costs = profile_speculation(model_dirs["tiny-llama"], 1, config, seed=0, log=lambda s: None)
    assert costs.draft_model == spec.draft_model
    assert costs.verify.measured
    plain = costs.verify.step_s(1, 100, verifies=False, seqs=1, keys=100)
    assert 0 < plain < costs.verify.step_s(9, 900, verifies=True, seqs=1, keys=108)  # drafts cost something
    if method == "suffix":
        assert costs.draft_pass is None and costs.prompt_with_draft is None
    else:
        assert costs.draft_pass.seconds(1, 1) > 0 and costs.prompt_with_draft.measured


def test_the_simulator_spec_benchmark_sets_each_prediction_beside_its_measurement(tmp_path, model_dirs,
                                                                                tiny_llama_draft):
    from pdserve.cluster.bench.report import key_of, publish
    from pdserve.cluster.bench.simulator_spec import SimSpecBenchConfig, run

    speculating_profile(str(tiny_llama_draft)).save(tmp_path / "profile.json")
    out = tmp_path / "simulator-spec.json"
    cfg = SimSpecBenchConfig(model=str(model_dirs["tiny-llama"]), draft_model=str(tiny_llama_draft),
                             profile=tmp_path / "profile.json", workloads=("code", "sampled"), batches=(1, 2),
                             repeats=1, prompt_len=32, output_len=8, out=out)
    result = run(cfg, log=lambda s: None)
    for workload in ("code", "sampled"):
        for batch in (1, 2):
            row = result.runs[workload][batch]
            assert set(row) == {"off", "suffix", "draft", "both"}
            assert all(c.measured_tpot_ms > 0 and c.predicted_tpot_ms > 0 for c in row.values())
            assert row["off"].drafting is None
            # every batch is predicted with the drafting measured at the first
            assert all(row[s].drafting == result.runs[workload][1][s].drafting for s in ("suffix", "draft", "both"))
            assert all(row[s].predicted_own_tpot_ms > 0 for s in ("suffix", "draft", "both"))
    page = tmp_path / "benchmarks.md"
    results = json.loads(out.read_text())
    publish(page, key_of(results), results)
    text = page.read_text()
    assert "## The cluster simulator's speculative decoding against the engine's" in text
    assert "| code | 2 |" in text and "Predicted speedup:" in text


def test_a_draft_model_catches_up_only_over_what_its_kv_lacks():
    from types import SimpleNamespace

    from pdserve.cluster.plan.sim_speculation import SimSpeculation

    costs = speculating_profile("pystd-llama-draft").workers[1].speculation
    spec = SimpleNamespace(method="draft_model", max_draft_tokens=8, goodput_sizing=True)
    sim = SimSpeculation(costs, spec, Drafting(0.9, length=4.0), draft_kv_sent=True, seed="0")

    def step(behind: int):
        return sim.size([300], [100], [behind], DECODE_S, 0, 0)

    caught_up = step(0)
    (k,) = caught_up.lengths
    assert caught_up.by_model == [True] and k >= 2
    later = sum(DRAFT_PASS.seconds(1, 1) for _ in range(k - 1))
    assert caught_up.draft_s == pytest.approx(DRAFT_PASS.seconds(1, 1) + later)  # its newest token, then guesses
    assert step(3).draft_s == pytest.approx(DRAFT_PASS.seconds(1, 4) + later)  # a short lag rides the first pass
    assert step(500).draft_s == pytest.approx(DRAFT_PASS.seconds(1, 500) + DRAFT_PASS.seconds(1, 1) + later)


def test_once_caught_up_a_draft_model_pays_only_its_drafting_passes_each_step():
    m = manifest(speculative=speculative("draft_model", max_draft_tokens=4))
    simulator = ClusterSimulator(m, speculating_profile("pystd-llama-draft"), drafting=Drafting(0.8))
    simulator.run(one_at_a_time(1, 256, 3000, gap_s=1.0))  # the average of its steps (~50) long settled
    decode = next(e for name, e in simulator.engines.items() if name.startswith("decode"))
    # four passes of one token each step (the newest, then three guesses): no catch-up after the first
    assert decode.decode_shape.propose_s == pytest.approx(4 * DRAFT_PASS.seconds(1, 1), rel=0.02)


def test_pdserve_plan_takes_a_workloads_drafting_where_the_manifest_speculates_and_only_there(capsys):
    from pdserve.cluster.cli import main

    base = ["plan", "--slo-ttft", "300", "--slo-tpot", "40", "--cpus", "2"]
    speculating = str(Path(DEFAULT_MANIFEST).parent / "speculative.yaml")
    for args, said in (
            (["--manifest", speculating], "give the workload's --acceptance"),
            (["--acceptance", "0.8"], "the manifest has no `speculative` section"),
            (["--manifest", speculating, "--acceptance", "0.8", "--draft-length", "9"], "more than the manifest's "
                                                                                         "max_draft_tokens (8)"),
            (["--manifest", speculating, "--acceptance", "1.3"], "a chance in [0, 1]")):
        assert main(base + args) == 2
        assert said in capsys.readouterr().err

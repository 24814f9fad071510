"""The policy benchmark's pure parts: configurations' manifests, workloads with fresh tokens per run, the
figures and targets from constructed records and router counters, the rates, the estimate, the CLI."""

from __future__ import annotations

import json

import pytest

from pdserve.cluster.bench.policies import (
    CONFIGS,
    TRACES,
    PairResult,
    PolicyBenchConfig,
    assemble,
    check_targets,
    estimate_s,
    figures,
    load_workload,
    manifest_for,
    parse_rates,
    plot,
    router_delta,
    short_cut,
    tables,
)
from pdserve.cluster.bench.report import key_of, publish
from pdserve.cluster.bench.serve_metrics import Goodput, Objective, RequestRecord
from pdserve.cluster.bench.workload import TraceRequest, prefix_group_sample, run_seed
from pdserve.cluster.cli import main
from pdserve.cluster.manifest import load_manifest

VOCAB = 1000


def record(prompt_len: int, ttft: float, cached: int | None = 0, outcome: str = "ok", n: int = 4,
           request_id: str = "r") -> RequestRecord:
    if outcome != "ok":
        return RequestRecord(request_id, "c", 1.0, 0.0, prompt_len, max_tokens=n, end_time=0.01, outcome=outcome)
    times = [ttft + 0.01 * i for i in range(n)]
    return RequestRecord(request_id, "c", 1.0, 0.0, prompt_len, max_tokens=n, first_token_time=times[0],
                         token_times=times, end_time=times[-1], output_tokens=n, cached_tokens=cached)


def counters(**kw) -> dict:
    base = dict.fromkeys(("requests_routed", "prompt_tokens", "predicted_cached_tokens", "oracle_cached_tokens",
                          "local_prefills", "early_rejections"), 0)
    return {**base, "per_worker": {}, **kw}


# --- configurations -------------------------------------------------------------------------------
def test_every_configuration_is_the_same_cluster_with_its_own_router():
    cfg = PolicyBenchConfig()
    manifests = {c: manifest_for(c, cfg) for c in CONFIGS}
    for c, m in manifests.items():
        assert m["mode"] == "disaggregated" and m["model"] == "llama-20m" and m["max_model_len"] == 1024
        assert m["server"]["address"] == "127.0.0.1:0"
        pools = m["pools"]
        assert (pools["prefill"]["replicas"], pools["decode"]["replicas"]) == (4, 1)
        assert pools["prefill"]["threads"] == pools["decode"]["threads"] == 1
        assert 4 * pools["prefill"]["num_cpus"] + pools["decode"]["num_cpus"] <= 2  # fits the 2 cores
        assert {k: m["router"][k] for k in CONFIGS[c].router} == CONFIGS[c].router
    assert manifests["round_robin"]["router"]["policy"] == "round_robin"
    base = manifests["estimated_ttft"]["router"]
    assert manifests["estimated_ttft-fcfs"]["router"] == {**base, "length_aware": False}
    assert manifests["estimated_ttft-always-disaggregate"]["router"] == {**base, "local_prefill_tokens": 0}
    assert list(CONFIGS)[0] == "estimated_ttft"  # it calibrates and sets the short cut
    routers = {c: load_manifest(m).router for c, m in manifests.items()}  # valid manifests
    assert routers["estimated_ttft"].laps and not routers["estimated_ttft-fcfs"].laps
    assert routers["estimated_ttft-always-disaggregate"].local_prefill_tokens == 0


def test_quick_is_two_configurations_on_one_trace():
    q = PolicyBenchConfig().quick()
    assert q.configs == ("estimated_ttft", "round_robin") and q.traces == ("mooncake",)
    assert q.max_runs == 1 and q.requests <= 8 and q.prefill_replicas == 2
    shapes = load_workload(q.traces[0], q, VOCAB).shapes
    assert all(s.prompt_len + s.output_len <= 256 and s.output_len <= 4 for s in shapes)  # short requests
    assert estimate_s(q, {}) < 100


def test_the_default_run_fits_the_time_budget():
    cfg = PolicyBenchConfig()
    assert estimate_s(cfg, {}) < 35 * 60
    assert estimate_s(cfg, dict.fromkeys(cfg.traces, 2.0)) > estimate_s(cfg, dict.fromkeys(cfg.traces, 8.0))


def test_rates_from_the_command_line():
    traces = ("mooncake", "azure-conv")
    assert parse_rates(["3", "mooncake=1.5"], traces) == {"mooncake": 1.5, "azure-conv": 3.0}
    assert parse_rates([], traces) == {}
    for bad in (["fast"], ["0"], ["azure-code=2"], ["mooncake=-1"]):
        with pytest.raises(ValueError):
            parse_rates(bad, traces)


# --- workloads ------------------------------------------------------------------------------------
def test_prefix_groups_are_taken_whole_in_trace_order():
    reqs = [TraceRequest(float(i), 8, 2, hash_ids=h) for i, h in
            enumerate([(1, 2), (3,), (1, 5), (), (3, 4), (6,), (1,)])]
    picked = prefix_group_sample(reqs, 5)
    assert [r.arrival_s for r in picked] == [0, 1, 2, 4, 6]  # groups 1 and 3, whole, in trace order
    assert [r.arrival_s for r in prefix_group_sample(reqs, 2)] == [0, 2]  # the first group, cut
    assert len(prefix_group_sample(reqs, 100)) == len(reqs)


def test_workloads_fit_the_model_and_share_prefixes_only_within_a_run():
    cfg = PolicyBenchConfig(requests=48)
    for name in TRACES:
        w = load_workload(name, cfg, VOCAB)
        assert len(w.shapes) == 48
        assert all(s.prompt_len + s.output_len <= cfg.max_model_len and 2 <= s.output_len <= 32 for s in w.shapes)
    w = load_workload("mooncake", cfg, VOCAB)
    assert w.shapes[0].block_tokens == 16  # one 512-token hash block is one KV block

    def blocks(requests):
        return {tuple(r.token_ids[i:i + 16]) for r in requests for i in range(0, len(r.token_ids) - 15, 16)}

    run, again, other = w.requests(0, "4.2"), w.requests(0, "4.2"), w.requests(0, "8.4")
    assert [r.token_ids for r in run] == [r.token_ids for r in again]  # the same run in every configuration
    assert not blocks(run) & blocks(other)  # no run finds another's blocks in a cache
    assert not blocks(run) & blocks(w.requests(1, "4.2"))
    assert not blocks(run) & blocks(load_workload("azure-conv", cfg, VOCAB).requests(0, "4.2"))
    # Within the run, equal hash ids give equal tokens: a good part of the prompts is shared.
    total = sum(len(r.token_ids) for r in run)
    assert len(blocks(run)) * 16 < 0.6 * total
    assert run_seed(0, "mooncake", "4.2") != run_seed(0, "mooncake", "8.4")


# --- figures and targets --------------------------------------------------------------------------
def test_router_counters_over_a_run():
    before = counters(prompt_tokens=100, local_prefills=2, per_worker={"prefill-0": 3})
    after = counters(prompt_tokens=250, local_prefills=5, oracle_cached_tokens=40,
                     per_worker={"prefill-0": 4, "prefill-1": 2})
    d = router_delta(before, after)
    assert d["prompt_tokens"] == 150 and d["local_prefills"] == 3 and d["oracle_cached_tokens"] == 40
    assert d["per_worker"] == {"prefill-0": 1, "prefill-1": 2}


def test_figures_of_one_run():
    recs = [record(100, 0.1, cached=50, request_id="a"), record(300, 0.5, cached=0, request_id="b"),
            record(50, 0.2, cached=48, request_id="c"), record(80, 0.0, outcome="rejected", request_id="d")]
    router = counters(requests_routed=4, prompt_tokens=530, oracle_cached_tokens=106, predicted_cached_tokens=53,
                      local_prefills=1, per_worker={"prefill-0": 2},
                      prefix_oracle={"a": 64, "b": 0, "c": 48, "d": 64})  # d was rejected: not counted
    f = figures(recs, router, short_cut=100)
    assert f["hit_rate"] == pytest.approx(98 / 450)  # the requests whose cached tokens the client saw
    assert f["oracle_hit_rate"] == pytest.approx(112 / 450) and f["predicted_hit_rate"] == pytest.approx(0.1)
    assert f["placement_oracle_hit_rate"] == pytest.approx(0.2)
    assert f["hit_vs_oracle"] == pytest.approx(98 / 112)
    assert f["short_requests"] == 2 and f["short_ttft_p90_s"] == pytest.approx(0.19)
    assert f["hit_requests"] == 2 and f["hit_ttft_p90_s"] == pytest.approx(0.19) and f["cold_ttft_p50_s"] == 0.5
    assert f["ttft_p90_s"] == pytest.approx(0.44) and f["rejected"] == 1 and f["ok"] == 3
    assert f["local_prefills"] == 1 and f["per_worker"] == {"prefill-0": 2}
    f = figures(recs, counters(), short_cut=None)
    assert f["oracle_hit_rate"] is None and f["hit_vs_oracle"] is None and f["short_ttft_p90_s"] is None


def test_prefix_oracle_counts_the_longest_block_prefix_shared_with_an_earlier_request():
    from pdserve.cluster.bench.policies import prefix_oracle
    from pdserve.cluster.bench.loadgen import Request

    a = list(range(100, 148))  # three blocks of 16
    reqs = [Request("a", a + [1], 2), Request("b", a[:32] + [7] * 20, 2), Request("c", a + [2, 3], 2),
            Request("d", a[:16], 2)]
    # b shares two blocks with a; c all three (its last token is never cached); d's only block is its
    # last token's: nothing can be cached.
    assert prefix_oracle(reqs, 16) == {"a": 0, "b": 32, "c": 48, "d": 0}


def test_short_cut_comes_from_estimated_ttft_first():
    assert short_cut({"round_robin": {"short_prompt_tokens": 64}, "estimated_ttft": {"short_prompt_tokens": 128}},
                     [10, 20, 30]) == (128, "short_prompt_tokens of estimated_ttft")
    assert short_cut({"round_robin": {"short_prompt_tokens": 64}}, [10, 20, 30])[0] == 64
    assert short_cut({"round_robin": {"short_prompt_tokens": None}}, [10, 20, 30])[0] == 20


def test_targets_side_by_side():
    table = {
        "mooncake": {"estimated_ttft": {"ttft_p90_s": 0.1, "hit_vs_oracle": 0.95},
                     "round_robin": {"ttft_p90_s": 0.3},
                     "estimated_ttft-always-disaggregate": {"ttft_p90_s": 0.09}},
        "azure-conv": {"estimated_ttft": {"ttft_p90_s": 0.2, "short_ttft_p90_s": 0.05},
                       "estimated_ttft-fcfs": {"short_ttft_p90_s": 0.1},
                       "estimated_ttft-always-disaggregate": {"ttft_p90_s": 0.2}},
        "azure-code": {"estimated_ttft": {"ttft_p90_s": 0.2, "short_ttft_p90_s": 0.09},
                       "estimated_ttft-fcfs": {"short_ttft_p90_s": 0.1}},
    }
    got = {(t["trace"], t["id"]): (t["measured"], t["pass"]) for t in check_targets(table)}
    assert got.pop(("mooncake", "vs_round_robin")) == (pytest.approx(3.0), True)
    assert got.pop(("mooncake", "hit_vs_oracle")) == (0.95, True)
    assert got.pop(("azure-conv", "short_vs_fcfs")) == (pytest.approx(0.5), True)
    assert got.pop(("azure-code", "short_vs_fcfs")) == (pytest.approx(0.1), False)
    assert got.pop(("mooncake", "vs_always_disaggregate")) == (pytest.approx(0.1 / 0.09), False)
    assert got.pop(("azure-conv", "vs_always_disaggregate")) == (pytest.approx(1.0), True)
    assert got.pop(("azure-code", "vs_always_disaggregate")) == (None, None)  # not measured: not a pass
    assert not got

def test_results_and_plots_from_constructed_runs(tmp_path):
    cfg = PolicyBenchConfig(configs=("estimated_ttft", "round_robin"), traces=("mooncake", "azure-conv"), requests=6,
                            out_dir=tmp_path)
    workloads = {t: load_workload(t, cfg, VOCAB) for t in cfg.traces}
    results = {}
    for t, w in workloads.items():
        w.rate, w.objective = 2.0, Objective("loose", 0.3, 0.05)
        for i, c in enumerate(cfg.configs):
            r = results[t, c] = PairResult(t, c)
            r.runs[2.0] = [record(s.prompt_len, 0.1 * (i + 1), cached=s.prompt_len // 2, request_id=f"r{j}")
                           for j, s in enumerate(w.shapes)]
            r.router[2.0] = counters(prompt_tokens=sum(s.prompt_len for s in w.shapes),
                                     oracle_cached_tokens=sum(s.prompt_len for s in w.shapes) // 2,
                                     prefix_oracle={f"r{j}": s.prompt_len // 2 for j, s in enumerate(w.shapes)})
            r.goodput = Goodput(w.objective, 2.0, None, 1.0, converged=False, note="run budget (1) spent")
    results["azure-conv", "round_robin"] = PairResult("azure-conv", "round_robin", error="RuntimeError: down")
    settings = {"estimated_ttft": {"short_prompt_tokens": 100}, "round_robin": {"short_prompt_tokens": None}}
    cuts, table = tables(workloads, results, settings)
    out = json.loads(json.dumps(assemble(cfg, tmp_path, workloads, results, settings,
                                         {"round_robin": "RuntimeError: down"}, cuts, table)))
    mooncake = out["traces"]["mooncake"]
    assert mooncake["short_prompt_tokens"]["cut"] == 100 and mooncake["rate"] == 2.0
    assert mooncake["configs"]["estimated_ttft"]["at_rate"]["hit_vs_oracle"] == pytest.approx(1.0, abs=0.01)
    assert mooncake["configs"]["round_robin"]["goodput"]["rate"] == 2.0
    assert out["traces"]["azure-conv"]["configs"]["round_robin"] == {"error": "RuntimeError: down", "at_rate": None,
                                                                    "goodput": None, "runs": []}
    assert {(t["trace"], t["id"]): t["pass"] for t in out["targets"]}[("mooncake", "vs_round_robin")] is True
    assert [p.name for p in plot(cfg, workloads, results, table, tmp_path)] == ["ttft_p90.png", "hit_rate.png",
                                                                               "ttft_cdf.png"]
    # Its section of the benchmarks page: each trace's configurations side by side, then the targets.
    page = tmp_path / "benchmarks.md"
    publish(page, key_of(out), out)
    text = page.read_text()
    assert "## Placement policies side by side" in text and "2 prefill + 1 decode worker(s)" not in text
    assert "4 prefill + 1 decode worker(s)" in text and "6 requests per run" in text
    assert "**mooncake** (6 requests;" in text and "at 2 req/s" in text
    assert "objective TTFT ≤ 300 ms, TPOT ≤ 50 ms" in text
    assert "| estimated_ttft | 100.0 ms | 100.0 ms |" in text and "| round_robin | 200.0 ms | 200.0 ms |" in text
    assert "| round_robin | RuntimeError: down |" in text
    assert "| mooncake | TTFT p90: round_robin / estimated_ttft | 2.00 | 2 | pass |" in text


# --- command line ---------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["bench", "serve", "--policies", "--trace", "azure2023_code.csv"],  # the serve benchmark's option
    ["bench", "serve", "--traces", "mooncake"],  # the policy benchmark's option, without --policies
    ["bench", "serve", "--policies", "--rate", "mooncake=fast"],
])
def test_options_of_the_other_benchmark_are_refused(argv, capsys):
    assert main(argv) == 2
    assert "pdserve: error:" in capsys.readouterr().err

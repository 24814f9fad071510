"""The profiler, the cluster simulator and the planner (`pdserve.cluster.plan`): queueing against closed
forms, the router's own placement inside, a known cost function recovered, and the planner's choices."""

from __future__ import annotations

import random
import statistics
from collections import deque
from dataclasses import replace
from types import SimpleNamespace

import pytest
import yaml
from cluster_helpers import manifest as small_cluster_manifest
from plan_helpers import synthetic_profile

from pdserve.cluster.bench.serve_metrics import TARGET_ATTAINMENT, Goodput, Objective, attainment, summarize
from pdserve.cluster.bench.workload import TraceRequest
from pdserve.cluster.manifest import DEFAULT_MANIFEST, load_manifest
from pdserve.client import Client
from pdserve.cluster.launcher import Cluster
from pdserve.cluster.plan.costs import (DecodeTable, HardwareProfile, TransferCost, WorkerCosts, default_profile_path,
                                        find_stored_profile, machine)
from pdserve.cluster.plan.planner import Candidate, Evaluated, Infeasible, candidates, choose, plan, tunings
from pdserve.cluster.plan.profiler import profile_engine
from pdserve.cluster.plan.simulator import (NOT_SIMULATED, ClusterSimulator, MissBudget, SimRequest, trace_requests,
                                            unique_prompt)
from pdserve.engine.cost_model import StepCost
from pdserve.engine.model_store import model_digest
from pdserve.engine.llm_engine import StepStats
from pdserve.wire import LifetimeEvent


def manifest(**changes) -> object:
    data = yaml.safe_load(DEFAULT_MANIFEST.read_text())
    data.update(model="llama-20m", max_model_len=4096, max_num_batched_tokens=4096)
    for key, value in changes.items():
        if key == "pools":
            for pool, spec in value.items():
                data["pools"].setdefault(pool, {}).update(spec)
        elif key == "router":
            data["router"].update(value)
        else:
            data[key] = value
    return load_manifest(data)


def single_server(**changes) -> object:
    """One colocated worker taking one request at a time: a single-server queue."""
    return manifest(**{"mode": "colocated", "max_num_seqs": 1,
                       "pools": {"prefill": {"replicas": 0}, "decode": {"replicas": 1}}, **changes})


def poisson(n: int, rate: float, lengths, seed: int = 1) -> list[SimRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        out.append(SimRequest(t, unique_prompt(i + 1, lengths(rng)), 1))
    return out


def mean_ttft(records) -> float:
    return statistics.fmean(r.ttft for r in records)


# --- queueing against closed forms -------------------------------------------------------------------
def test_deterministic_service_queues_as_m_d_1():
    service = 0.010  # every prompt pass: a + b·n with one length
    profile = synthetic_profile(StepCost(0.002, 0.008 / 100, 0.0))
    rate = 70.0  # ρ = 0.7
    records = ClusterSimulator(single_server(), profile).run(poisson(20_000, rate, lambda rng: 100)).records
    rho = rate * service
    expected = service + rho * service / (2 * (1 - rho))  # Pollaczek-Khinchine, deterministic service
    assert mean_ttft(records) == pytest.approx(expected, rel=0.05)
    assert all(r.outcome == "ok" for r in records)


def test_exponential_service_queues_as_m_m_1():
    mean_tokens, per_token = 200, 0.00005  # a geometric length: exponential service of mean 10 ms
    profile = synthetic_profile(StepCost(0.0, per_token, 0.0))
    rate = 60.0
    records = ClusterSimulator(single_server(), profile).run(
        poisson(20_000, rate, lambda rng: 1 + int(rng.expovariate(1 / mean_tokens)))).records
    mu = 1 / (mean_tokens * per_token)
    assert mean_ttft(records) == pytest.approx(1 / (mu - rate), rel=0.07)


@pytest.mark.parametrize("rate, fails", [(60.0, False), (150.0, True)])
def test_a_run_past_its_miss_budget_stops_there_with_the_full_runs_verdict(rate, fails):
    """A goodput search needs only whether a run met its target: one that no longer can stops (an
    overloaded single server: its queue grows to the end), every request recorded; one that can runs
    to its end, exactly as without the budget."""
    profile = synthetic_profile(StepCost(0.002, 0.008 / 100, 0.0))  # 10 ms a prompt: 100 req/s at most
    objective = Objective("ttft", 0.05, 1.0)
    requests = poisson(2_000, rate, lambda rng: 100)
    full = ClusterSimulator(single_server(), profile).run(requests, rate)
    budgeted = ClusterSimulator(single_server(), profile).run(requests, rate, MissBudget(objective, TARGET_ATTAINMENT))
    assert (attainment(full.records, objective) < TARGET_ATTAINMENT) is fails
    assert (attainment(budgeted.records, objective) < TARGET_ATTAINMENT) is fails
    assert budgeted.stopped is fails and len(budgeted.records) == len(requests)
    if fails:
        assert budgeted.events < full.events / 2, (budgeted.events, full.events)
        assert all(r.outcome == "error" and r.error == NOT_SIMULATED
                   for r in budgeted.records if r.end_time is None and r.first_token_time is None)
    else:
        assert budgeted.records == full.records


# --- the cluster inside -------------------------------------------------------------------------------
def test_a_disaggregated_run_goes_through_the_routers_placement_and_hands_every_prompt_off():
    profile = synthetic_profile(StepCost(0.003, 0.0001, 0.0), decode_s=0.005, handoff=TransferCost(0.004, 0.0))
    m = manifest(pools={"prefill": {"replicas": 1}, "decode": {"replicas": 2}}, router={"local_prefill_tokens": 0})
    requests = [SimRequest(i * 0.01, unique_prompt(i + 1, 200), 10) for i in range(60)]
    result = ClusterSimulator(m, profile).run(requests, rate=100.0)
    assert result.routing["requests_routed"] == 60 and result.routing["local_prefills"] == 0
    assert sorted(result.routing["per_worker"]) == ["prefill-0"]
    decode_steps = [result.workers[w].steps for w in ("decode-1", "decode-2")]
    assert all(decode_steps), decode_steps  # both decode workers got requests
    for r in result.records:
        assert r.outcome == "ok" and r.output_tokens == 10
        # the handoff comes between the first token and the second: TPOT over 9 steps carries it
        assert r.end_time - r.first_token_time >= 0.004 + 9 * 0.005 - 1e-9


def test_shared_prefixes_are_found_through_the_routers_index():
    profile = synthetic_profile(StepCost(0.002, 0.0001, 0.0))
    m = manifest(mode="colocated", pools={"prefill": {"replicas": 1}, "decode": {"replicas": 1}})
    system = list(range(1, 513))  # a 512-token prefix every request shares
    requests = [SimRequest(i * 0.2, system + [1000 + i] * 64, 4) for i in range(20)]
    records = ClusterSimulator(m, profile).run(requests).records
    assert records[0].cached_tokens == 0
    assert all(r.cached_tokens == 512 for r in records[1:])


def test_trace_blocks_are_shared_within_a_pass_over_the_shapes_and_never_across_passes():
    """Shapes naming the same block ids share those prompt blocks (16 tokens each here); the second
    pass over the shapes (more arrivals than shapes) shares nothing with the first."""
    profile = synthetic_profile(StepCost(0.002, 0.0001, 0.0))
    m = manifest(mode="colocated", pools={"prefill": {"replicas": 1}, "decode": {"replicas": 1}})
    shapes = [TraceRequest(0.0, 72, 4, (7, 8, 9), 16), TraceRequest(0.0, 72, 4, (7, 8, 5), 16),
              TraceRequest(0.0, 40, 4)]
    requests = trace_requests(shapes, [i * 0.2 for i in range(6)])
    assert requests[0].prompt[:32] == requests[1].prompt[:32] and requests[0].prompt[32:48] != requests[1].prompt[32:48]
    assert requests[0].prompt[48:] != requests[1].prompt[48:]  # past the named blocks: each its own
    assert not set(requests[3].prompt[:48]) & set(requests[0].prompt[:48]) - {0}
    records = ClusterSimulator(m, profile).run(requests).records
    assert [r.cached_tokens for r in records] == [0, 32, 0, 0, 32, 0]


def test_a_full_kv_pool_preempts_and_every_request_still_ends_whole():
    profile = synthetic_profile(StepCost(0.001, 0.00001, 0.0), decode_s=0.001)
    m = single_server(max_num_seqs=32, kv_memory_mb=1, max_model_len=1024)  # 64 blocks of 16 tokens
    requests = [SimRequest(0.0, unique_prompt(i + 1, 100), 200) for i in range(16)]
    result = ClusterSimulator(m, profile).run(requests)  # the run checks every block came back
    assert result.workers["colocated-0"].preemptions > 0
    assert all(r.outcome == "ok" and r.output_tokens == 200 for r in result.records)


def test_decode_workers_short_of_kv_preempt_imports_and_every_request_still_ends_whole():
    profile = synthetic_profile(StepCost(0.002, 0.00001, 0.0), decode_s=0.002)
    m = manifest(max_model_len=1024, kv_memory_mb=1, max_num_seqs=32, router={"local_prefill_tokens": 0},
                 pools={"prefill": {"replicas": 2}, "decode": {"replicas": 1}})
    requests = [SimRequest(i * 0.001, unique_prompt(i + 1, 300), 300) for i in range(24)]
    result = ClusterSimulator(m, profile).run(requests)  # the run checks every block came back
    assert result.workers["decode-2"].preemptions > 0
    assert all(r.outcome == "ok" and r.output_tokens == 300 for r in result.records)


def test_a_decode_worker_answers_reservations_between_steps_and_its_next_prompt_waits_for_the_answer():
    step = 0.05
    profile = synthetic_profile(StepCost(0.002, 0.00001, 0.0), decode_s=step)
    m = manifest(router={"local_prefill_tokens": 0}, pools={"prefill": {"replicas": 1}, "decode": {"replicas": 1}})
    busy = SimRequest(0.0, unique_prompt(1, 100), 40)  # keeps the decode worker stepping for 2 s
    longs = [SimRequest(0.2, unique_prompt(i + 2, 1500), 2) for i in range(4)]  # 17 ms passes
    records = ClusterSimulator(m, profile).run([busy, *longs]).records
    starts = sorted(r.events[LifetimeEvent.PREFILL_START] for r in records[1:])
    # each prompt's pass starts once the previous one's reservation was answered: the first at the end of
    # the decode step running when it was asked, each later one a whole step after it was asked
    assert starts[1] > starts[0] and all(b - a >= step - 1e-9 for a, b in zip(starts[1:], starts[2:])), starts
    for r in records[1:]:  # its KV waited for that answer too, and was committed between decode steps
        assert r.events[LifetimeEvent.DECODE_START] - r.events[LifetimeEvent.PREFILL_START] >= step - 1e-9


def test_the_feeder_waits_for_its_prompts_to_join_the_engine_between_steps():
    profile = synthetic_profile(StepCost(0.01, 0.0005, 0.0))  # a 2,000-token pass: about a second
    m = manifest(router={"local_prefill_tokens": 0}, pools={"prefill": {"replicas": 1}, "decode": {"replicas": 1}})
    a, b, c = (SimRequest(t, unique_prompt(i + 1, 2000), 2) for i, t in enumerate((0.0, 0.1, 0.2)))
    ra, rb, rc = ClusterSimulator(m, profile).run([a, b, c]).records
    assert rb.events[LifetimeEvent.PREFILL_START] == pytest.approx(0.1)  # taken at once ...
    # ... but it joins the engine only when a's step ends, and until then the feeder takes nothing more
    assert rc.events[LifetimeEvent.PREFILL_START] >= ra.events[LifetimeEvent.PREFILL_END]


def test_each_prefill_worker_waits_only_for_its_own_reservations():
    step = 0.05
    profile = synthetic_profile(StepCost(0.002, 0.00001, 0.0), decode_s=step)
    m = manifest(router={"local_prefill_tokens": 0, "prefill_policy": "round_robin"},
                 pools={"prefill": {"replicas": 2}, "decode": {"replicas": 1}})
    busy = SimRequest(0.0, unique_prompt(1, 100), 40)  # keeps the decode worker stepping
    longs = [SimRequest(0.2, unique_prompt(i + 2, 1500), 2) for i in range(2)]  # one on each prefill worker
    records = ClusterSimulator(m, profile).run([busy, *longs]).records
    starts = [r.events[LifetimeEvent.PREFILL_START] for r in records[1:]]
    assert starts == [0.2, 0.2]  # neither waits for the other's reservation on the shared decode worker


def test_one_token_requests_end_their_reservations_and_every_block_comes_back():
    # The decode worker's KV holds one 300-token request besides a few blocks: reservations wait for
    # room, and requests that end at their first token (released by their prefill worker) must end them.
    profile = synthetic_profile(StepCost(0.002, 0.00001, 0.0), decode_s=0.002)
    m = manifest(max_model_len=1024, kv_memory_mb=1, router={"local_prefill_tokens": 0},
                 pools={"prefill": {"replicas": 1}, "decode": {"replicas": 1}})
    requests = [SimRequest(i * 0.001, unique_prompt(i + 1, 600), 1 if i % 3 else 200) for i in range(18)]
    result = ClusterSimulator(m, profile).run(requests)  # the run checks every block came back, and never spins
    assert all(r.outcome == "ok" and r.output_tokens == (1 if i % 3 else 200) for i, r in enumerate(result.records))


def test_early_rejection_refuses_what_cannot_meet_the_ttft_objective():
    profile = synthetic_profile(StepCost(0.01, 0.0001, 0.0))  # a 900-token prompt's pass: 100 ms
    m = manifest(router={"ttft_slo_s": 0.1})  # refused past 2 x 100 ms: the second in line would wait 200 ms
    requests = [SimRequest(0.0, unique_prompt(i + 1, 900), 2) for i in range(10)]
    records = ClusterSimulator(m, profile).run(requests).records
    assert [r.outcome for r in records] == ["ok"] + ["rejected"] * 9
    assert summarize(records)["rejected"] == 9 and "no prefill worker can meet the TTFT objective" in records[1].error


# --- the profiler's fit -------------------------------------------------------------------------------
class SyntheticEngine:
    """Continuous batching with a known step cost: a waiting prompt's pass runs alone, else every
    decoding sequence decodes one token. Enough of `LLMEngine` for the profiler."""

    def __init__(self, prefill: StepCost, decode) -> None:
        self.prefill, self.decode = prefill, decode
        self.config = SimpleNamespace(max_num_batched_tokens=2048, max_num_seqs=64, block_size=16)
        self.max_model_len, self.vocab_size = 1024, 100
        self.waiting: deque[list[int]] = deque()
        self.decoding: list[list[int]] = []  # [context, tokens left]
        self.last_step = StepStats()

    @property
    def num_free_blocks(self) -> int:
        return 100_000

    def add_request(self, prompt, params) -> None:
        self.waiting.append([len(prompt), params.max_tokens])

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.decoding)

    def step(self) -> None:
        if self.waiting:
            n, left = self.waiting.popleft()
            self.last_step = StepStats(1, n, n * n, 0, total_s=self.prefill.step_s(n, n * n))
            if left > 1:
                self.decoding.append([n + 1, left - 1])
            return
        batch = len(self.decoding)
        context = sum(c for c, _ in self.decoding)
        self.last_step = StepStats(batch, batch, context, batch, total_s=self.decode(batch, context / batch))
        for seq in self.decoding:
            seq[0] += 1
            seq[1] -= 1
        self.decoding = [s for s in self.decoding if s[1] > 0]


def test_the_profilers_fit_recovers_a_known_cost_function():
    prefill = StepCost(0.004, 0.0002, 3e-8)

    def decode(batch: int, context: float) -> float:  # bilinear: the table interpolates it exactly
        return 0.008 + 0.0005 * batch + 2e-6 * context + 1e-7 * batch * context

    costs, checks = profile_engine(SyntheticEngine(prefill, decode), threads=1, seed=0, log=lambda s: None)
    assert costs.prefill.as_tuple() == pytest.approx(prefill.as_tuple(), rel=1e-6)
    assert checks["prefill_error_max"] < 1e-6
    for batch, context in ((1, 20), (6, 300), (24, 77), (64, 500)):
        assert costs.decode.step_s(batch, context) == pytest.approx(decode(batch, context), rel=0.01)


def test_a_profile_round_trips_through_its_file(tmp_path):
    profile = synthetic_profile(StepCost(0.001, 0.0002, 1e-8), threads=(1, 2))
    profile.workers[2] = replace(profile.workers[2], mixed_scale=1.2)
    profile.dispatch_s, profile.prefill_setup_s, profile.router_cpu_s_per_token, profile.cores = 0.003, 0.005, 0.002, 2
    profile.save(tmp_path / "p.json")
    assert HardwareProfile.load(tmp_path / "p.json") == profile
    (tmp_path / "old.json").write_text('{"format": 0}')
    with pytest.raises(ValueError, match="pdserve profile"):
        HardwareProfile.load(tmp_path / "old.json")


def stored_profile_of(model_dir, hardware: str) -> HardwareProfile:
    return replace(synthetic_profile(StepCost(0.004, 2e-5, 3e-9)), model=model_dir.name,
                   model_digest=model_digest(model_dir), hardware=hardware, device="cpu")


def test_a_stored_profile_is_found_only_for_these_model_bytes_on_this_machine(tmp_path, monkeypatch, model_dirs):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    model_dir = model_dirs["tiny-llama"]
    assert find_stored_profile("tiny-llama", model_dir, "this machine") is None
    profile = stored_profile_of(model_dir, "this machine")
    of_other_bytes = replace(profile, model_digest="f" * 64)  # the same name, another checkpoint
    of_other_bytes.save(default_profile_path("tiny-llama", of_other_bytes.model_digest, "this machine"))
    assert find_stored_profile("tiny-llama", model_dir, "this machine") is None
    path = default_profile_path("tiny-llama", profile.model_digest, "this machine")
    profile.save(path)
    assert find_stored_profile("tiny-llama", model_dir, "this machine") == (path, profile.model_digest)
    assert find_stored_profile("tiny-llama", model_dir, "another machine") is None


def test_a_stored_profile_a_cluster_cannot_use_is_passed_over_and_its_workers_measure(tmp_path, monkeypatch,
                                                                                       model_dirs):
    """`profile: auto` reads a profile the user never named: one it cannot read or use costs nothing but
    a line in the start-up log."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    model_dir = model_dirs["tiny-llama"]
    stored = stored_profile_of(model_dir, machine())
    path = default_profile_path(model_dir.name, stored.model_digest, machine())
    path.parent.mkdir(parents=True)
    lines: list[str] = []
    cluster = Cluster(small_cluster_manifest(model_dir), log=lines.append)
    for unusable, why in ((lambda: path.write_text('{"format": 2, "model'), "cannot read the profile"),
                          (lambda: path.write_text("[]"), "not an object"),
                          (lambda: replace(stored, dtype="bfloat16").save(path), "measured bfloat16")):
        unusable()
        assert cluster._stored_step_costs(model_dir) == {}
        assert why in lines[-1] and "the workers measure their prompt passes" in lines[-1], lines[-1]
    stored.save(path)
    assert cluster._stored_step_costs(model_dir) == {(1, "cpu"): stored.workers[1].prefill}


def test_a_cluster_takes_its_workers_prompt_costs_from_a_stored_profile_instead_of_measuring(model_dirs, tmp_path,
                                                                                              monkeypatch):
    """Found where `pdserve profile` stores it (`profile: auto`, the default); a file named by the
    manifest must be of its model."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    model_dir = model_dirs["tiny-llama"]
    one_worker = {"prefill": {"replicas": 0}, "decode": {"num_cpus": 0.5}}
    stored = stored_profile_of(model_dir, machine())
    with pytest.raises(ValueError, match="profile: no profile file at"):  # a misspelt keyword reads as a path
        small_cluster_manifest(model_dir, profile="mesure")
    of_another_model = tmp_path / "another.json"
    replace(stored, model_digest="0" * 64).save(of_another_model)
    with pytest.raises(ValueError, match="is of another model"):  # refused before any worker starts
        Cluster(small_cluster_manifest(model_dir, "colocated", pools=one_worker, profile=str(of_another_model)),
                log=lambda _: None).start()
    path = default_profile_path(model_dir.name, stored.model_digest, machine())
    stored.save(path)
    lines: list[str] = []
    m = small_cluster_manifest(model_dir, "colocated", pools=one_worker)
    assert m.profile == "auto"
    with Cluster(m, log=lines.append) as cluster:
        assert any(f"from the profile {path}" in line for line in lines), lines
        assert not any("profiling prompt passes" in line for line in lines), lines
        (worker,) = cluster.workers
        known, reported = stored.workers[1].prefill, worker.status.step_cost  # what the router's cost model reads
        assert [reported.a, reported.b, reported.c] == pytest.approx([known.a, known.b, known.c], rel=1e-6)
        with Client(cluster.address, timeout=60) as client:
            assert len(client.generate([5] * 30, max_tokens=4, ignore_eos=True).token_ids) == 4


# --- the planner --------------------------------------------------------------------------------------
def shapes(n: int, prompt: int = 64, output: int = 8) -> list[TraceRequest]:
    return [TraceRequest(0.0, prompt, output) for _ in range(n)]


def test_the_planner_carries_a_rate_with_the_fewest_cpus_that_can():
    # A worker decodes 4 requests at a time, 8 tokens of 50 ms each: about 10 req/s at most.
    profile = synthetic_profile(StepCost(0.02, 0.00001, 0.0), decode_s=0.05, threads=(1,))
    base = manifest(max_num_seqs=4)
    objective = Objective("test", ttft_s=1.0, tpot_s=0.2)
    one = plan(base, profile, shapes(50), objective, cpus=1, min_duration_s=10, log=lambda s: None)
    three = plan(base, profile, shapes(50), objective, cpus=3, target_rate=one.best.goodput.rate * 2.5,
                 min_duration_s=10, log=lambda s: None)
    assert one.best.candidate.cpus == 1 and one.best.goodput.rate > 0
    assert three.best.candidate.cpus == 3  # 2.5 workers' worth needs three
    assert three.best.goodput.rate >= one.best.goodput.rate * 2.5
    cheaper = [e for e in three.tried if e.candidate.cpus < three.best.candidate.cpus]
    assert all(e.goodput.rate < one.best.goodput.rate * 2.5 for e in cheaper)


def test_the_planner_tunes_the_deployments_near_the_best_one_setting_at_a_time():
    profile = synthetic_profile(StepCost(0.002, 0.0001, 0.0), decode_s=0.005)
    base = manifest(max_num_batched_tokens=2048)
    trace = shapes(40, prompt=200)
    result = plan(base, profile, trace, Objective("t", ttft_s=0.3, tpot_s=0.04), cpus=2, min_duration_s=3,
                  log=lambda s: None)
    first = candidates(base, profile, 2)
    tried = [e.candidate for e in result.tried]
    assert tried[:len(first)] == first
    top = max(e.goodput.rate for e in result.tried[:len(first)])
    near = [e.candidate for e in result.tried[:len(first)] if e.goodput.rate >= top * 0.75]
    tuned = tried[len(first):]
    assert near and tuned
    for c in near:
        variants = [t for t in tuned if (t.mode, t.prefill, t.decode) == (c.mode, c.prefill, c.decode)]
        if c.mode == "colocated" and c.step_budget == 2048:
            assert {t.step_budget for t in variants} >= {512, 1024}
        elif c.mode == "disaggregated":
            assert {t.router for t in variants} == {(("local_prefill_tokens", 0),), (("local_prefill_tokens", 200),),
                                                   (("long_prompt_chunk_tokens", 512),),
                                                   (("long_prompt_chunk_tokens", 2048),)}
            tuned_manifest = next(t for t in variants if t.router[0][1] == 200).manifest(base)
            assert tuned_manifest.router.local_prefill_tokens == 200 and tuned_manifest.mode == "disaggregated"
    far = [e.candidate for e in result.tried[:len(first)] if e.goodput.rate < top * 0.75]
    assert not [t for t in tuned for c in far if (t.mode, t.prefill, t.decode) == (c.mode, c.prefill, c.decode)
                and not any((t.mode, t.prefill, t.decode) == (n.mode, n.prefill, n.decode) for n in near)]
    assert len(set(tuned)) == len(tuned)


def test_without_laps_the_planner_tunes_no_laps_chunk():
    base = manifest(max_num_batched_tokens=2048, router={"length_aware": False, "local_prefill_tokens": 0})
    candidate = next(c for c in candidates(base, synthetic_profile(StepCost(0.002, 0.0001, 0.0)), 2)
                     if c.mode == "disaggregated")
    assert [t.router for t in tunings(candidate, base, shapes(10, prompt=300))] == [(("local_prefill_tokens", 300),)]


def evaluated(cpus: int, rate: float, failed: float | None = None, attainment: float = 0.95,
              carries: bool | None = None) -> Evaluated:
    candidate = Candidate("colocated", (0, 0), (cpus, 1), 256 + int(rate * 1000) + int((failed or 0) * 10))
    return Evaluated(candidate, Goodput(Objective("t", 1.0, 1.0), rate, failed, attainment, True), 1, carries)


def test_the_planners_pick_among_ties_and_at_a_target_rate():
    # within 5% of the best: fewer CPUs first, then the higher goodput, the higher first miss, more margin
    assert choose([evaluated(4, 10.0), evaluated(2, 9.6), evaluated(2, 9.0)]).goodput.rate == 9.6
    assert choose([evaluated(2, 10.0, failed=11.0), evaluated(2, 10.0, failed=20.0)]).goodput.failed_rate == 20.0
    assert choose([evaluated(2, 10.0, failed=12.0, attainment=0.91),
                   evaluated(2, 10.0, failed=12.0, attainment=0.99)]).goodput.attainment == 0.99
    assert choose([evaluated(4, 10.0), evaluated(2, 5.0)]).candidate.cpus == 4  # no tie: the best goodput
    # a target rate: the fewest CPUs that carry it, whatever carries more
    assert choose([evaluated(4, 10.0, carries=True), evaluated(3, 6.0, carries=True),
                   evaluated(2, 9.0, carries=False)], target_rate=5.0).candidate.cpus == 3


def test_the_planner_refuses_an_impossible_objective_naming_the_bottleneck():
    profile = synthetic_profile(StepCost(0.02, 0.0001, 0.0), decode_s=0.005)
    with pytest.raises(Infeasible, match=r"prefill: the trace's p90 prompt \(64 tokens\) alone takes 26 ms"):
        plan(manifest(), profile, shapes(40), Objective("t", ttft_s=0.010, tpot_s=1.0), cpus=2, log=lambda s: None)
    with pytest.raises(Infeasible, match=r"decode: one decode step alone takes 5.0 ms"):
        plan(manifest(), profile, shapes(40), Objective("t", ttft_s=1.0, tpot_s=0.001), cpus=2, log=lambda s: None)


# --- the command line ---------------------------------------------------------------------------------
def test_pdserve_plan_writes_a_manifest_that_loads_and_its_plot(tmp_path, capsys):
    from pdserve.cluster.cli import main

    from pdserve.engine.model_store import model_digest
    from pdserve.engine.models.presets import resolve_model

    profile = synthetic_profile(StepCost(0.002, 0.0001, 0.0), decode_s=0.005, threads=(1,))
    profile.model_digest = model_digest(resolve_model("llama-20m"))
    profile.save(tmp_path / "p.json")
    args = ["plan", "--slo-ttft", "300", "--slo-tpot", "40", "--cpus", "2", "--model", "llama-20m", "--profile",
            str(tmp_path / "p.json"), "--requests", "30", "--run-seconds", "3", "--out", str(tmp_path / "planned.yaml"),
            "--plot",
            str(tmp_path / "frontier.png")]
    assert main(args) == 0
    planned = (tmp_path / "planned.yaml").read_text()
    assert planned.startswith("# Planned by `pdserve plan`") and "predicted goodput" in planned
    chosen = load_manifest(yaml.safe_load(planned))
    assert chosen.model == "llama-20m" and chosen.mode in planned.splitlines()[1]
    assert (tmp_path / "frontier.png").read_bytes()[:4] == b"\x89PNG"
    assert "best:" in capsys.readouterr().out


def test_pdserve_plan_without_a_profile_says_how_to_make_one(tmp_path, capsys):
    from pdserve.cluster.cli import main

    assert main(["plan", "--slo-ttft", "300", "--slo-tpot", "40", "--cpus", "2", "--profile",
                 str(tmp_path / "none.json")]) == 2
    assert f"measure it first with `pdserve profile --profile {tmp_path / 'none.json'}`" in capsys.readouterr().err


def test_pdserve_plan_refuses_a_profile_of_another_model(tmp_path, capsys):
    from pdserve.cluster.cli import main

    synthetic_profile(StepCost(0.002, 0.0001, 0.0)).save(tmp_path / "p.json")
    assert main(["plan", "--slo-ttft", "300", "--slo-tpot", "40", "--cpus", "2", "--model", "llama-20m",
                 "--profile", str(tmp_path / "p.json")]) == 2
    assert "is of another model (synthetic" in capsys.readouterr().err


def test_kv_memory_that_cannot_hold_one_sequence_is_refused_as_the_engine_does():
    with pytest.raises(ValueError, match="holds 1024 tokens of synthetic's KV, less than one sequence of max_model_l"):
        ClusterSimulator(single_server(kv_memory_mb=1), synthetic_profile(StepCost(0.001, 0.0, 0.0)))


def test_a_request_longer_than_the_context_is_refused():
    m = single_server(kv_memory_mb=1, max_model_len=1024)
    records = ClusterSimulator(m, synthetic_profile(StepCost(0.001, 0.0, 0.0))).run(
        [SimRequest(0.0, unique_prompt(1, 1000), 100), SimRequest(0.0, unique_prompt(2, 100), 2)]).records
    assert [r.outcome for r in records] == ["error", "ok"] and "longer than max_model_len 1024" in records[0].error


def test_workers_sharing_too_few_cores_step_in_proportion_slower():
    profile = synthetic_profile(StepCost(0.010, 0.0, 0.0))
    m = manifest(mode="colocated", pools={"prefill": {"replicas": 1}, "decode": {"replicas": 1}},
                 router={"policy": "round_robin"})
    both = [SimRequest(0.0, unique_prompt(i + 1, 32), 1) for i in range(2)]  # one prompt pass on each worker
    apart = ClusterSimulator(m, profile, shared_cores=2).run(both).records
    shared = ClusterSimulator(m, profile, shared_cores=1).run(both).records
    assert [r.ttft for r in apart] == pytest.approx([0.010, 0.010])
    assert sorted(r.ttft for r in shared) == pytest.approx([0.010, 0.020])  # the second starts beside the first


def test_what_serving_adds_lands_where_it_is_measured():
    base = synthetic_profile(StepCost(0.010, 0.0, 0.0), decode_s=0.005, handoff=TransferCost(0.0, 0.0))
    added = synthetic_profile(StepCost(0.010, 0.0, 0.0), decode_s=0.005, handoff=TransferCost(0.0, 0.0))
    added.dispatch_s, added.prefill_setup_s, added.delivery_s, added.step_overhead_s = 0.002, 0.030, 0.001, 0.004
    m = manifest(router={"local_prefill_tokens": 0})
    request = [SimRequest(0.0, unique_prompt(1, 64), 5)]
    plain, serving = (ClusterSimulator(m, p).run(request).records[0] for p in (base, added))
    assert serving.ttft - plain.ttft == pytest.approx(0.002 + 0.030 + 0.001)
    assert serving.tpot - plain.tpot == pytest.approx(0.004)


@pytest.mark.parametrize("layerwise_min_tokens", [0, 1024], ids=["beside the pass", "after the pass"])
def test_simulated_records_carry_lifetime_events_in_order(layerwise_min_tokens):
    """The reservation is asked for as the pass starts where the KV streams beside it, else as it ends
    (the sender's `pass_started`): the decode worker answers between its (idle) steps, at once."""
    profile = synthetic_profile(StepCost(0.005, 0.0, 0.0), decode_s=0.002, handoff=TransferCost(0.003, 0.0))
    profile.dispatch_s = 0.001
    m = manifest(router={"local_prefill_tokens": 0, "length_aware": False},  # no short-batch window
                 kv_transfer={"layerwise_min_tokens": layerwise_min_tokens})
    events = ClusterSimulator(m, profile).run([SimRequest(0.0, unique_prompt(1, 64), 4)]).records[0].events
    reserved = events.pop("kv_reserved")
    order = ["accepted", "prefill_queued", "prefill_start", "prefill_end", "first_token", "decode_start", "finished"]
    assert list(sorted(events, key=events.get)) == order
    assert reserved == pytest.approx(events["prefill_start"] if layerwise_min_tokens == 0 else events["prefill_end"])
    assert events["prefill_start"] - events["accepted"] == pytest.approx(0.001)
    assert events["decode_start"] - events["prefill_end"] == pytest.approx(0.003)


def test_a_mixed_step_costs_its_parts_times_the_measured_scale_and_never_less_than_its_decode():
    table = DecodeTable((1, 64), (16, 1024), ((0.010, 0.010), (0.010, 0.010)))
    costs = WorkerCosts(1, StepCost(0.004, 0.0001, 0.0), table, mixed_scale=1.5)
    assert costs.step_s(4, 400, 0, 0) == pytest.approx(0.010)  # decode alone: unscaled
    assert costs.step_s(4, 400, 100, 10_000) == pytest.approx((0.010 + 0.010) * 1.5)
    assert replace(costs, mixed_scale=0.1).step_s(4, 400, 100, 10_000) == pytest.approx(0.010)


def test_the_routers_cpu_slows_workers_that_share_its_cores():
    profile = synthetic_profile(StepCost(0.010, 0.0, 0.0), decode_s=0.010)
    m = single_server(max_num_seqs=8)
    requests = [SimRequest(0.0, unique_prompt(i + 1, 32), 50) for i in range(4)]
    alone = ClusterSimulator(m, profile, shared_cores=1).run(requests).records
    profile.router_cpu_s_per_token = 0.05  # a core from 20 tokens a second on (capped at one core)
    shared = ClusterSimulator(m, profile, shared_cores=1).run(requests).records
    assert statistics.median(r.tpot for r in alone) == pytest.approx(0.010)
    assert statistics.median(r.tpot for r in shared) == pytest.approx(0.020, rel=0.1)


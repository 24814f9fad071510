"""The online planner's decisions, on a profile with known costs: it moves toward the split a shifted
mix needs, one worker at a time and only when confirmed (at once when the current split cannot carry the
traffic), and never flaps on a stationary workload."""

from __future__ import annotations

import random
import re
import struct
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import yaml
from cluster_helpers import manifest
from helpers import random_prompts, worker_status
from plan_helpers import synthetic_profile

from pdserve.client import Client
from pdserve.cluster.launcher import Cluster
from pdserve.cluster.manifest import DEFAULT_MANIFEST, load_manifest
from pdserve.cluster.status import fetch_health
from pdserve.engine.model_store import model_digest
from pdserve.cluster.plan.online import RESIMULATE_AFTER, OnlinePlanner, Split, split_goodput
from pdserve.engine.block_pool import hash_prompt_blocks
from pdserve.engine.cost_model import StepCost
from pdserve.router.frontend import ObservedRequest

# A prompt token costs 0.2 ms of prefill (a 1,500-token prompt: 0.3 s); a decode step 10 ms, 8 requests
# at a time: long prompts with short answers want prefill workers, short prompts with long answers decode.
PROFILE = synthetic_profile(StepCost(0.002, 0.0002, 0.0), decode_s=0.01)
CHAT = (32, 200)  # prompt, output
SUMMARIES = (1500, 4)


def base(**planner) -> object:
    data = yaml.safe_load(DEFAULT_MANIFEST.read_text())
    data.update(model="llama-20m", max_model_len=4096, max_num_batched_tokens=4096, max_num_seqs=8)
    data["pools"]["prefill"]["replicas"] = data["pools"]["decode"]["replicas"] = 2
    data["planner"] = {"online": True, "ttft_slo_s": 2.0, "tpot_slo_s": 0.05, "window_s": 60, "min_requests": 20,
                       "confirmations": 2, "cooldown_s": 0, **planner}
    return load_manifest(data)


def window(mix: tuple[int, int], end: float, rate: float = 1.0, seed: int = 0) -> list[ObservedRequest]:
    """A minute of requests of one mix (lengths varying by a fifth) ending at `end`."""
    rng = random.Random(seed)
    n = int(60 * rate)
    return [ObservedRequest(end - 60 + i / rate, max(1, round(mix[0] * rng.uniform(0.8, 1.2))),
                             max(1, round(mix[1] * rng.uniform(0.8, 1.2)))) for i in range(n)]


@pytest.mark.parametrize("mix, direction", [(CHAT, "decode"), (SUMMARIES, "prefill")])
def test_a_shifted_mix_moves_one_worker_toward_its_split_once_confirmed(mix, direction):
    planner = OnlinePlanner(base(), PROFILE)
    first = planner.decide(60.0, window(mix, 60.0), Split(2, 2))
    assert first.action == "wait" and first.step is None, first  # best once: not yet
    second = planner.decide(90.0, window(mix, 90.0, seed=1), Split(2, 2))
    assert second.action == "change", second
    assert second.step == (Split(1, 3) if direction == "decode" else Split(3, 1))
    better = second.goodputs[str(second.best)]
    assert better >= 1.15 * second.goodputs["2P+2D"] and "moving one worker" in second.reason


def test_a_split_that_cannot_carry_the_traffic_is_changed_at_once():
    """Confirmations guard a split that carries the traffic; one predicted to carry less than the
    measured rate loses requests while it waits, so the first decision moves."""
    planner = OnlinePlanner(base(), PROFILE)
    decision = planner.decide(60.0, window(SUMMARIES, 60.0, rate=8.0), Split(2, 2))
    assert decision.goodputs["2P+2D"] < 8.0, decision
    assert decision.action == "change" and decision.step == Split(3, 1), decision
    assert "at once: 2P+2D is predicted to carry less than the measured rate" in decision.reason


def test_a_stationary_workload_never_flaps():
    """Ten decisions over the same mix, each change applied, with room to add and remove workers: the
    changes all go one way (no worker added then removed, none switched and switched back), and then
    the split is kept."""
    planner = OnlinePlanner(base(min_workers=2, max_workers=4), PROFILE)
    split, steps = Split(2, 2), set()
    for i in range(10):
        now = 60.0 + 30 * i
        decision = planner.decide(now, window(CHAT, now, seed=i), split)
        if decision.action == "change":
            steps.add((decision.step.prefill - split.prefill, decision.step.decode - split.decode))
            split = decision.step
    assert not any((-dp, -dd) in steps for dp, dd in steps), steps
    assert planner.decide(500.0, window(CHAT, 500.0, seed=99), split).action == "keep"


def test_an_unchanged_mix_reuses_the_last_goodputs_and_a_shifted_one_is_simulated_again():
    """The simulations cost the workers' idle CPU: a window whose mix is the last simulated one's (the
    split kept) takes its goodputs over, at most RESIMULATE_AFTER times in a row; a shifted mix, or a
    change wanted, is simulated afresh."""
    asked: list[int] = []

    def counted(questions):
        asked.append(len(questions))
        return [split_goodput(q) for q in questions]

    planner = OnlinePlanner(base(), PROFILE, goodputs=counted)
    decisions = [planner.decide(60.0 + 30 * i, window(CHAT, 60.0 + 30 * i, seed=i), Split(1, 3))
                 for i in range(RESIMULATE_AFTER + 2)]
    assert [d.action for d in decisions] == ["keep"] * len(decisions), decisions
    assert [d.simulated for d in decisions] == [True] + [False] * RESIMULATE_AFTER + [True]
    assert "goodputs of an earlier decision, the mix unchanged" in decisions[1].reason
    assert len(asked) == 2
    shifted = planner.decide(600.0, window(SUMMARIES, 600.0), Split(1, 3))
    assert shifted.simulated and shifted.action == "wait", shifted  # a change wanted: confirmed by a new simulation
    assert planner.decide(630.0, window(SUMMARIES, 630.0, seed=1), Split(1, 3)).simulated


@pytest.mark.parametrize("mix, rate, grows", [(CHAT, 6.0, "decode"), (SUMMARIES, 3.0, "prefill")])
def test_more_traffic_than_the_workers_carry_adds_one_to_the_pool_it_needs(mix, rate, grows):
    planner = OnlinePlanner(base(min_workers=2, max_workers=5, confirmations=1), PROFILE)
    decision = planner.decide(60.0, window(mix, 60.0, rate=rate), Split(1, 1))
    assert decision.action == "change", decision
    assert decision.step == (Split(1, 2) if grows == "decode" else Split(2, 1))
    assert decision.goodputs["1P+1D"] < 1.25 * rate <= decision.goodputs[str(decision.step)]
    assert f"adding a {grows} worker" in decision.reason
    assert set(decision.goodputs) == {"1P+1D", "1P+2D", "2P+1D"}  # one more worker at most, never fewer than 2


def test_light_traffic_removes_a_worker_and_moderate_traffic_keeps_them():
    """One fewer worker must carry the headroom over the measured rate by twice the margin more: at 0.5
    req/s it does; at 4 req/s 1P+1D is predicted to carry 5 req/s, the headroom's 5 but not 30% more."""
    planner = OnlinePlanner(base(min_workers=2, max_workers=5, confirmations=1), PROFILE)
    light = planner.decide(60.0, window(CHAT, 60.0, rate=0.5), Split(1, 2))
    assert light.action == "change" and light.step == Split(1, 1), light
    assert "removing a decode worker" in light.reason
    moderate = OnlinePlanner(base(min_workers=2, max_workers=5, confirmations=1), PROFILE)
    kept = moderate.decide(60.0, window(CHAT, 60.0, rate=4.0), Split(1, 2))
    assert kept.action == "keep", kept
    assert 1.25 * 4.0 <= kept.goodputs["1P+1D"] < 1.25 * 4.0 * 1.3


def test_a_cluster_outside_its_budget_is_brought_back_and_an_empty_pool_is_left_alone():
    """Workers removed by hand below `min_workers`: one is added back whatever the traffic; a pool
    emptied by hand: no decision (the planner simulates no empty pool)."""
    planner = OnlinePlanner(base(min_workers=3, max_workers=5, confirmations=1), PROFILE)
    below = planner.decide(60.0, window(CHAT, 60.0, rate=0.5), Split(1, 1))
    assert below.action == "change" and below.step.total == 3 and "outside the budget" in below.reason, below
    empty = planner.decide(120.0, window(CHAT, 120.0), Split(0, 3))
    assert empty.action == "none" and "empty pool" in empty.reason


def test_no_decision_without_enough_requests_and_none_during_the_cooldown():
    planner = OnlinePlanner(base(cooldown_s=120, confirmations=1), PROFILE)
    few = planner.decide(60.0, window(CHAT, 60.0)[:5], Split(2, 2))
    assert few.action == "none" and "fewer than 20" in few.reason
    assert planner.decide(60.0, window(CHAT, 60.0), Split(2, 2)).action == "change"
    cooling = planner.decide(90.0, window(SUMMARIES, 90.0), Split(1, 3))
    assert cooling.action == "wait" and "the last change was 30 s ago" in cooling.reason


def test_the_worker_to_remove_or_switch_is_a_failed_one_then_one_alone_on_its_node_then_the_least_held():
    from types import SimpleNamespace

    from pdserve.cluster.replanning import ReplanLoop
    from pdserve.router.workers import WorkerRef

    def on(node: str, name: str, pool: str = "decode", outstanding: int = 0) -> WorkerRef:
        return WorkerRef(name, pool, handle=None, status=worker_status(node_id=node), outstanding=outstanding)

    shared_a, shared_b, alone = on("head", "d0"), on("head", "d1"), on("added", "d2", outstanding=3)
    workers = [shared_a, shared_b, alone, on("head", "p0", "prefill"), on("added2", "p1", "prefill")]
    loop = ReplanLoop(SimpleNamespace(workers=workers), planner=None, say=lambda _: None)
    assert loop._worker_to_take("decode") is alone  # busier, but its node goes idle without it
    assert loop._worker_to_take("prefill").name == "p1"
    shared_b.healthy = False
    assert loop._worker_to_take("decode") is shared_b  # one that stopped serving, first


def test_the_manifest_refuses_an_online_planner_with_nothing_to_reshape():
    data = yaml.safe_load(DEFAULT_MANIFEST.read_text())
    data["planner"] = {"online": True}
    with pytest.raises(ValueError, match="at least 3 workers"):
        load_manifest(data)  # 1 prefill + 1 decode
    data["pools"]["decode"]["replicas"] = 2
    data["profile"] = "measure"
    with pytest.raises(ValueError, match="stored profile"):
        load_manifest(data)


def test_the_windows_prefix_reuse_is_simulated_as_it_was_served():
    """Long prompts that share all but their last blocks (a system prompt, say) are predicted to go
    further than the same lengths unshared: the router's block ids travel with each finished request."""
    shared = struct.pack("<88Q", *range(1, 89))  # 88 blocks of 16 tokens: 1,408 of each prompt's ~1,500

    def reused(r: ObservedRequest, i: int) -> ObservedRequest:
        own = struct.pack("<Q", 10_000 + i) * ((r.prompt_len - 1) // 16 - 88)
        return replace(r, block_ids=shared + own, block_size=16)

    plain = window(SUMMARIES, 60.0, rate=2.0)
    with_reuse = [reused(r, i) for i, r in enumerate(plain)]
    unshared = OnlinePlanner(base(), PROFILE).decide(60.0, plain, Split(2, 2))
    sharing = OnlinePlanner(base(), PROFILE).decide(60.0, with_reuse, Split(2, 2))
    reuse = [int(re.search(r"(\d+)% of prompt blocks seen before", d.reason).group(1)) for d in (unshared, sharing)]
    assert reuse[0] == 0 and reuse[1] >= 90, reuse  # 88 of about 93 blocks, after the first request
    assert all(sharing.goodputs[k] > unshared.goodputs[k] for k in ("1P+3D", "2P+2D")), (sharing, unshared)


def test_a_profile_without_the_transport_the_cluster_hands_off_over_is_refused_at_once():
    data = base().model_dump(mode="json")
    data["kv_transfer"]["transport"] = "tcp"
    with pytest.raises(ValueError, match="pdserve profile --transports tcp"):
        OnlinePlanner(load_manifest(data), PROFILE)  # the profile measured shm only


def test_in_a_cluster_the_planner_turns_a_decode_worker_into_a_prefill_worker_when_prompts_dominate(
        tmp_path, model_dirs, hf_reference):
    """1 prefill + 2 decode workers and long prompts with short answers: the planner (deciding every
    second, on a profile where prompt tokens are dear) moves a decode worker to the prefill pool while
    requests run; every request completes exact, none retried, and /health and /metrics say so."""
    model = model_dirs["tiny-llama"]
    profile = replace(synthetic_profile(StepCost(0.002, 0.0004, 0.0), decode_s=0.002),
                      model_digest=model_digest(model), max_model_len=512)
    profile.save(tmp_path / "profile.json")
    planner = {"online": True, "ttft_slo_s": 2.0, "tpot_slo_s": 0.1, "interval_s": 1, "window_s": 30,
               "min_requests": 8, "confirmations": 1, "cooldown_s": 0}
    pools = {"prefill": {"replicas": 1, "num_cpus": 0.25}, "decode": {"replicas": 2, "num_cpus": 0.25}}
    m = manifest(model, pools=pools, profile=str(tmp_path / "profile.json"), planner=planner)
    prompts = random_prompts(120, hf_reference["tiny-llama"].vocab_size, 300, 400, seed=47)
    said: list[str] = []
    served: list[tuple[list[int], list[int]]] = []
    stop = threading.Event()
    with Cluster(m, log=said.append) as cluster, Client(cluster.address, timeout=120) as client:

        def load(part: list[list[int]]) -> None:  # requests keep coming while the planner decides and acts
            for prompt in part:
                if stop.is_set():
                    return
                served.append((prompt, client.generate(prompt, max_tokens=4, ignore_eos=True, temperature=0).token_ids))

        with ThreadPoolExecutor(2) as pool:
            loaders = [pool.submit(load, prompts[i::2]) for i in range(2)]
            deadline = time.monotonic() + 120
            while not cluster.router_stack.server.health_report().planner.role_changes:
                assert time.monotonic() < deadline, said
                time.sleep(0.1)
            stop.set()
            for loader in loaders:
                loader.result()
        health = fetch_health(cluster.http_address)
        pools_now = sorted(w.pool for w in cluster.workers)
        metrics = urllib.request.urlopen(f"http://{cluster.http_address}/metrics", timeout=10).read().decode()
        retries = cluster.router.stats.retries
        completed = cluster.observed_requests()
        bs = cluster.manifest.block_size
    assert pools_now == ["decode", "prefill", "prefill"], said
    assert served and all(tokens == hf_reference["tiny-llama"].greedy(p, 4) for p, tokens in served)
    assert retries == 0
    # Each finished request carries its prompt's block ids, as the router hashed them (the planner's reuse).
    sent = {b"".join(h[:8] for h in hash_prompt_blocks(p[:(len(p) - 1) // bs * bs], bs)) for p, _ in served}
    assert completed and all(r.block_ids in sent and r.block_size == bs for r in completed)
    assert health["planner"]["role_changes"] == 1 and "2P+1D" in health["planner"]["reason"] + " ".join(said)
    assert any(line.startswith("planner: decode-") for line in said)
    assert 'pdserve_planner_decisions_total{action="change"} 1.0' in metrics

"""Each placement policy's decisions on constructed states, and the router's own steps around them
(conditional disaggregation, early rejection, bookkeeping, the oracle's count)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
from helpers import worker_status

from pdserve.engine.block_pool import hash_prompt_blocks
from pdserve.engine.cost_model import StepCost, StepCostModel
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.admission import Overloaded
from pdserve.router.policies import POLICY_NAMES, RouteRequest, TransferCost, make_policy
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.routing import Router, RoutingSettings
from pdserve.router.workers import NoHealthyWorker, QueuedPrefill, WorkerRef
from pdserve.wire import WorkRequest

BS = 16
COST = (0.010, 0.0004, 2.5e-7)  # a, b, c: about what llama-20m measures on one CPU thread


def worker(name: str, pool: str = "prefill", outstanding: int = 0, free: int = 1000, total: int = 1000,
           short: int = 0, step_cost: StepCost = StepCost(*COST)) -> WorkerRef:
    return WorkerRef(name, pool, None, outstanding=outstanding,
                     status=worker_status(free, total, step_cost, chunk_tokens=256, short_prompt_tokens=short))


def request(n: int, matches: dict[str, int] | None = None, max_tokens: int = 16) -> RouteRequest:
    return RouteRequest("r", n, max_tokens, BS, matches=matches or {})


def choose(name: str, pool: str, req: RouteRequest, workers: list[WorkerRef], **options) -> str:
    return make_policy(name, pool, TransferCost(), options).choose(req, workers).worker.name


# --- each policy ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["round_robin", "least_loaded"])
def test_each_pool_takes_turns_when_requests_alternate_between_pools(name):
    policy = make_policy(name, "decode", TransferCost())
    prefill = [worker("prefill-0")]
    decode = [worker(f"decode-{i}", "decode") for i in range(2)]
    picks = Counter()
    for _ in range(10):  # idle: least_loaded ties everywhere and must still share
        policy.choose(request(8), prefill)
        picks[policy.choose(request(8), decode).worker.name] += 1
    assert picks == {"decode-0": 5, "decode-1": 5}


def test_least_loaded_prefers_the_emptier_worker():
    workers = [worker("a", outstanding=3), worker("b", outstanding=1)]
    assert {choose("least_loaded", "prefill", request(8), workers) for _ in range(4)} == {"b"}


def test_cache_aware_follows_the_longest_prefix_above_the_match_threshold():
    workers = [worker("a", outstanding=0), worker("b", outstanding=2)]
    assert choose("cache_aware", "prefill", request(160, {"b": 6}), workers) == "b"  # 96 of 160 > half
    assert choose("cache_aware", "prefill", request(160, {"b": 4}), workers) == "a"  # 64 of 160: least loaded


def test_cache_aware_balances_load_first_when_it_is_out_of_balance():
    workers = [worker("a", outstanding=0), worker("b", outstanding=40)]
    assert choose("cache_aware", "prefill", request(160, {"b": 9}), workers) == "a"
    assert choose("cache_aware", "prefill", request(160, {"b": 9}), workers, balance_abs=64) == "b"


def test_kv_cost_weighs_blocks_to_prefill_against_blocks_held():
    a, b = worker("a"), worker("b")
    a.active_blocks, b.active_blocks = 0, 6
    req = request(160, {"b": 9})  # 10 blocks; b caches 9: cost a = 10 + 0, b = 1 + 6
    assert choose("kv_cost", "prefill", req, [a, b]) == "b"
    assert choose("kv_cost", "prefill", req, [a, b], overlap_weight=0.5) == "a"  # a 5, b 6.5


def test_estimated_ttft_prefill_takes_the_cached_prefix_unless_its_queue_costs_more():
    a, b = worker("a"), worker("b")
    req = request(512, {"b": 24})  # b caches 384 of 512 tokens
    assert choose("estimated_ttft", "prefill", req, [a, b]) == "b"
    b.queued = {f"q{i}": QueuedPrefill(900, 0, False) for i in range(3)}  # ~1 s of prompts ahead on b
    assert choose("estimated_ttft", "prefill", req, [a, b]) == "a"


def test_estimated_ttft_estimate_is_queue_plus_own_pass_plus_transfer():
    transfer = TransferCost()
    transfer.observe(16, 0.003)
    transfer.observe(256, 0.013)
    policy = make_policy("estimated_ttft", "prefill", transfer)
    w = worker("a")
    w.queued = {"q": QueuedPrefill(100, 0, False)}
    cost = StepCost(*COST)
    expected = cost.work_s(100, 100 * 100, 2048) + cost.prefill_s(200) + transfer.predict(200)
    assert policy.estimate_s(request(200), w) == pytest.approx(expected)


def test_a_short_prompt_waits_only_for_shorts_and_one_long_chunk():
    policy = make_policy("estimated_ttft", "prefill", TransferCost())
    w = worker("a", short=64)
    w.queued = {f"long{i}": QueuedPrefill(1000, 0, False) for i in range(4)}
    short, long_ = request(32), request(600)
    cost = StepCost(*COST)
    assert policy.queue_s(short, w) == pytest.approx(cost.work_s(256, 256 * 256, 2048))  # one chunk ahead
    assert policy.queue_s(long_, w) == pytest.approx(cost.work_s(4000, 4 * 1000 * 1000, 2048))


def test_estimated_ttft_decode_needs_room_then_the_smallest_batch():
    full = worker("full", "decode", outstanding=0, free=2)
    busy = worker("busy", "decode", outstanding=5)
    light = worker("light", "decode", outstanding=1)
    assert choose("estimated_ttft", "decode", request(160), [full, busy, light]) == "light"


def test_estimated_ttft_decode_breaks_ties_by_free_blocks_between_two_random_workers():
    workers = [worker(f"d{i}", "decode", free=100 * (i + 1)) for i in range(4)]
    policy = make_policy("estimated_ttft", "decode", TransferCost())
    picks = Counter(policy.choose(request(16), workers).worker.name for _ in range(200))
    assert "d0" not in picks  # never the emptiest-but-one... the least free never wins a pair
    assert picks["d3"] > picks["d2"] > picks["d1"] > 0  # the most free wins every pair it is in


def test_every_policy_name_builds_for_both_pools():
    for name in POLICY_NAMES:
        for pool in ("prefill", "decode"):
            assert make_policy(name, pool, TransferCost()).name == name
    with pytest.raises(ValueError, match="unknown placement policy"):
        make_policy("random", "prefill", TransferCost())


# --- cost models --------------------------------------------------------------------------------------
def test_step_cost_model_recovers_coefficients_and_stays_non_negative():
    rng = np.random.default_rng(0)
    model = StepCostModel(refit_every=8)
    a, b, c = 0.01, 0.0004, 3e-7
    model.add_profile([(n, n * n, a + b * n + c * n * n) for n in (4, 16, 64, 256, 1024)])
    for _ in range(64):  # online: decode-like steps with noise
        n = int(rng.integers(1, 64))
        q = n * int(rng.integers(1, 500))
        model.observe(n, q, (a + b * n + c * q) * (1 + 0.01 * rng.standard_normal()))
    got = model.coefficients
    assert got.a == pytest.approx(a, rel=0.1) and got.b == pytest.approx(b, rel=0.1) and got.c == pytest.approx(c, rel=0.1)
    flat = StepCostModel()
    flat.add_profile([(n, n * n, 0.05 - 1e-5 * n) for n in (4, 16, 64, 256)])  # falling: no negative slope
    assert min(flat.coefficients.as_tuple()) >= 0


def test_step_cost_model_forgets_steps_older_than_its_horizon():
    """Steps slowed by contention (an abort storm) count only while recent: once they age out, the
    next read refits from the profile and the newer steps, even when no step ran since."""
    now = [0.0]
    model = StepCostModel(refit_every=8, horizon_s=3.0, clock=lambda: now[0])
    a, b, c = 0.01, 0.0004, 3e-7
    model.add_profile([(n, n * n, a + b * n + c * n * n) for n in (4, 16, 64, 256, 1024)])
    for n in range(200, 264):  # big decode batches, three times slower per token than profiled
        model.observe(n, n * 300, a + 3 * b * n + c * n * 300)
    assert model.coefficients.prefill_s(32) > 1.5 * (a + b * 32 + c * 32 * 32)
    now[0] = 3.5
    assert model.coefficients.b == pytest.approx(b, rel=0.01)


# --- the router -----------------------------------------------------------------------------------------
def cached(index: PrefixIndex, worker_name: str, prompt: list[int], blocks: int) -> None:
    hashes = hash_prompt_blocks(prompt, BS)[:blocks]
    index.replace(worker_name, list(zip(hashes, [None] + hashes[:-1])))


def make_router(prefill: list[WorkerRef], decode: list[WorkerRef], index: PrefixIndex | None = None,
                **settings) -> Router:
    return Router("disaggregated", prefill, decode, BS, RoutingSettings(**settings), index or PrefixIndex())


def work(prompt: list[int], max_tokens: int = 8) -> WorkRequest:
    return WorkRequest("req", prompt, SamplingParams.greedy(max_tokens=max_tokens))


def test_router_books_load_until_first_token_and_end():
    p, d = worker("p"), worker("d", "decode")
    router = make_router([p], [d], local_prefill_tokens=0)
    placement = router.place(work(list(range(100))))
    assert placement.prefill is p and p.outstanding == d.outstanding == 1 and "req" in p.queued
    assert d.active_blocks == -(-108 // BS) and p.active_blocks == -(-100 // BS)
    router.first_token(placement)
    assert p.outstanding == 0 and not p.queued and p.active_blocks == 0 and d.outstanding == 1
    assert placement.depends_on == [p, d]  # the first token may leave before the KV handoff commits
    placement.handed_over()
    assert placement.depends_on == [d]
    router.finished(placement, {"prefill_end": 1.0, "decode_start": 1.25})
    router.finished(placement)  # a second end changes nothing
    assert d.outstanding == 0 and d.active_blocks == 0
    assert router.transfer.predict(100) > 0  # the transfer it saw


def test_router_prefills_locally_under_the_threshold_only():
    p, d = worker("p"), worker("d", "decode")
    router = make_router([p], [d], local_prefill_tokens=40)
    assert router.place(work(list(range(40)))).local
    assert not router.place(work(list(range(41)))).local
    index = PrefixIndex()
    prompt = list(range(100))
    cached(index, "d", prompt, 4)  # the decode worker caches 64 tokens: 36 left to compute there
    assert make_router([p], [d], index, local_prefill_tokens=40).place(work(prompt)).local
    assert make_router([p], [d], index, local_prefill_tokens=0).place(work(prompt)).local is False


def test_measured_local_prefill_threshold_is_where_compute_overtakes_transfer():
    p, d = worker("p"), worker("d", "decode")
    router = make_router([p], [d])
    assert router.local_prefill_limit(d) == 0  # no transfer seen yet: nothing is cheaper locally
    router.transfer.observe(16, 0.006)
    router.transfer.observe(256, 0.030)  # x0 = 4.4 ms, x1 = 0.1 ms/token
    limit = router.local_prefill_limit(d)
    cost = StepCost(*COST)
    assert cost.compute_s(limit) <= router.transfer.predict(limit) < cost.compute_s(limit + 1) + 1e-3
    assert 0 < limit < 100
    router.transfer.observe(512, 0.5)  # transfers got slow: now the decode batch's delay bounds it
    assert router.local_prefill_limit(d) == cost.max_tokens_within(cost.a, 2048) > limit
    assert make_router([p], [d], prefill_policy="least_loaded").local_prefill_limit(d) == 0


def test_a_step_cost_inflated_by_load_does_not_raise_the_local_prefill_bound():
    """A decode worker's fit under load gains a large fixed cost (its cores shared, its batches big):
    the bound stays at the least fixed cost it showed, or local prefills would load it further."""
    p, d = worker("p"), worker("d", "decode")
    router = make_router([p], [d])
    router.transfer.observe(16, 0.3)
    router.transfer.observe(256, 0.5)  # slow transfers: the decode step's fixed cost bounds it
    idle = router.local_prefill_limit(d)
    assert idle == StepCost(*COST).max_tokens_within(COST[0], 2048)
    d.status = dataclasses.replace(d.status, step_cost=StepCost(0.2, COST[1], COST[2]))
    assert router.local_prefill_limit(d) == idle
    assert not router.place(work(list(range(idle + 1)))).local


def test_a_decode_worker_with_no_measured_costs_prefills_nothing_itself():
    p, d = worker("p"), worker("d", "decode", step_cost=StepCost())
    router = make_router([p], [d])
    router.transfer.observe(16, 0.006)
    router.transfer.observe(256, 0.030)
    assert router.local_prefill_limit(d) == 0
    assert not router.place(work(list(range(8)))).local  # unmeasured is not free


def test_with_the_whole_prefill_pool_down_the_decode_worker_prefills():
    p, d = worker("p"), worker("d", "decode")
    p.healthy = False
    router = make_router([p], [d], local_prefill_tokens=0)
    placement = router.place(work(list(range(500))))
    assert placement.local and placement.prefill is None and router.stats.prefill_pool_down == 1
    assert router.place_again(work(list(range(500))), [], avoid=[p]).local
    d.healthy = False
    with pytest.raises(NoHealthyWorker, match="decode pool"):
        router.place(work(list(range(500))))


def test_a_measured_threshold_still_sends_prompts_away_from_a_busy_decode_worker():
    p, d = worker("p"), worker("d", "decode")
    router = make_router([p], [d])
    router.transfer.observe(16, 0.006)
    router.transfer.observe(256, 0.030)
    limit = router.local_prefill_limit(d)
    assert router.place(work(list(range(limit)))).local  # idle: the decode worker answers first
    d.queued.update({f"q{i}": QueuedPrefill(limit, 0, False) for i in range(40)})  # a line of local prefills
    assert not router.place(work(list(range(limit)))).local


def test_a_speculating_decode_workers_running_batch_is_priced_with_its_drafts():
    """A decode step verifies each sequence's drafts and drafts before it: a prompt prefilled there waits
    for that step, so its estimate counts the tokens per sequence and the drafting the worker reports."""
    plain = worker("d", "decode", outstanding=16)
    speculating = worker("d", "decode", outstanding=16)
    speculating.status = dataclasses.replace(speculating.status, step_tokens_per_seq=3.0, step_propose_s=0.002)
    request_, cost = request(100), StepCost(*COST)
    extra = Router.local_estimate_s(request_, speculating) - Router.local_estimate_s(request_, plain)
    assert extra == pytest.approx(cost.b * 16 * 2 + 0.002)
    idle = worker("d", "decode")
    idle.status = speculating.status
    assert Router.local_estimate_s(request_, idle) == Router.local_estimate_s(request_, worker("d", "decode"))


def test_early_rejection_when_the_best_estimate_misses_the_objective():
    p = worker("p")
    p.queued = {f"q{i}": QueuedPrefill(1000, 0, False) for i in range(8)}  # seconds of work ahead
    router = make_router([p], [worker("d", "decode")], local_prefill_tokens=0, ttft_slo_s=0.2)
    with pytest.raises(Overloaded, match="TTFT objective") as e:
        router.place(work(list(range(300))))
    assert e.value.retry_after_s > 1.0
    assert router.stats.early_rejections == 1 and p.outstanding == 0  # nothing booked
    relaxed = make_router([p], [worker("d", "decode")], local_prefill_tokens=0, ttft_slo_s=100.0)
    assert relaxed.place(work(list(range(300)))).prefill is p


def test_stats_count_the_oracle_and_the_prediction():
    index = PrefixIndex()
    prompt = list(range(200))
    cached(index, "a", prompt, 8)
    a, b = worker("a", outstanding=0), worker("b")
    router = make_router([a, b], [worker("d", "decode")], index, prefill_policy="round_robin",
                         local_prefill_tokens=0)
    picked = [router.place(work(prompt)).prefill.name for _ in range(2)]
    s = router.stats
    assert sorted(picked) == ["a", "b"]
    assert s.oracle_cached_tokens == 2 * 128 and s.predicted_cached_tokens == 128 and s.prompt_tokens == 400


def test_approximate_index_learns_from_the_routers_own_decisions():
    a, b = worker("a"), worker("b")
    router = make_router([a, b], [worker("d", "decode")], prefix_index="approximate", local_prefill_tokens=0,
                         prefill_policy="cache_aware")
    prompt = list(range(300, 500))
    first = router.place(work(prompt)).prefill
    router.first_token(router.place(work(prompt)))  # no events: the decision itself is the evidence
    again = router.place(work(prompt + [1, 2, 3]))
    assert again.prefill is first and again.request.cached_tokens(first) == 192
    assert router.stats.oracle_cached_tokens == 0  # the exact index (no events here) knows nothing


def test_a_moved_request_keeps_the_worker_that_prefilled_it_and_its_load_moves():
    p, d0, d1 = worker("p"), worker("d0", "decode"), worker("d1", "decode")
    router = make_router([p], [d0, d1], local_prefill_tokens=100)
    placement = router.place(work(list(range(40))))  # prefilled on its decode worker
    first = placement.decode
    other = d1 if first is d0 else d0
    router.first_token(placement)
    placement.handed_over()
    router.moved(placement, other)
    assert placement.decode is other and placement.depends_on == [other]
    assert placement.prefiller is first  # who served the prompt (metrics, the lifetime log) stays
    assert (first.outstanding, other.outstanding) == (0, 1)


def test_a_move_goes_to_a_worker_with_room_first_and_to_a_full_one_rather_than_nowhere():
    p, d0 = worker("p"), worker("d0", "decode")
    full, roomy = worker("d1", "decode", outstanding=2), worker("d2", "decode", outstanding=1, free=2)
    router = make_router([p], [d0, full, roomy], local_prefill_tokens=0, max_active_decodes=2)
    placement = router.place(work(list(range(40))))
    placement.decode = d0
    assert router.move_target(placement) is roomy  # d1 has the free KV the policy prefers, but no admission slot
    assert router.move_target(placement, {roomy: 1}) is full  # roomy's last slot is taken by a move under way
    roomy.draining = True
    assert router.move_target(placement) is full  # admitted once: a full worker takes it over none
    full.healthy = False
    with pytest.raises(NoHealthyWorker):
        router.move_target(placement)

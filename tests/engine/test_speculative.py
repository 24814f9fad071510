"""Speculative decoding in the engine: a step verifies every decoding sequence's own draft in one
packed pass, and the output is the one decoding without speculation gives, token for token.

Most tests drive the verification with a proposer that knows the true continuation (transformers'
greedy tokens, or the engine's own sampled ones) and spoils it at a random place, so that every step
mixes drafts accepted whole, in part and not at all; the suffix proposer is tested on its own and end
to end."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import TEST_PRESETS, assert_pool_idle, drain, random_prompts, run_all

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.block_pool import hash_prompt_blocks
from pdserve.engine.speculative.config import SpeculativeConfig
from pdserve.engine.sequence import Sequence
from pdserve.engine.speculative.draft import AcceptanceRecord, Draft, DraftRequest, DraftWorth
from pdserve.engine.speculative.sizing import DecodeCost, DecodeCostModel, DraftCandidate, draft_lengths
from pdserve.engine.speculative.suffix import RecentOutputs, SuffixProposer, TokenIndex

NEW_TOKENS = 24
GREEDY = SamplingParams.greedy(max_tokens=NEW_TOKENS, ignore_eos=True)


class SpoilingProposer:
    """Proposes each request's true next tokens (`truth[prompt]`), wrong from a random place on:
    `spoil` is the chance that a draft holds a wrong token."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], vocab_size: int, spoil: float, seed: int = 0) -> None:
        self.truth, self.vocab_size, self.spoil = truth, vocab_size, spoil
        self.rng = random.Random(seed)

    def propose(self, requests: list[DraftRequest], worth: DraftWorth) -> list[Draft]:
        return [self.propose_one(r.seq, r.max_tokens) for r in requests]

    def propose_one(self, seq: Sequence, max_tokens: int) -> Draft:
        done = len(seq.output_token_ids)
        draft = list(self.truth[tuple(seq.prompt_token_ids)][done : done + self.rng.randint(0, max_tokens)])
        if draft and self.rng.random() < self.spoil:
            wrong = self.rng.randrange(len(draft))
            draft[wrong] = (draft[wrong] + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
        return Draft(draft, [(1 - self.spoil) ** (j + 1) for j in range(len(draft))])

    def verified(self, seq: Sequence, draft: list[int], accepted: int) -> None:
        pass

    def finished(self, seq: Sequence) -> None:
        pass


def speculative_engine(model_dir, proposer=None, max_draft_tokens: int = 6, goodput_sizing: bool = False,
                       **kwargs) -> LLMEngine:
    """Drafts verified whole unless `goodput_sizing` (which depends on measured step times)."""
    kwargs.setdefault("kv_memory_bytes", 16 * 2**20)
    spec = SpeculativeConfig(max_draft_tokens=max_draft_tokens, goodput_sizing=goodput_sizing)
    engine = LLMEngine(model_dir, EngineConfig(speculative=spec, **kwargs))
    if proposer is not None:
        engine.proposer = proposer
    return engine


def spoiled_run(model_dirs, hf_reference, num_prompts: int, min_len: int, max_len: int, seed: int, spoil: float,
                **engine_kwargs) -> tuple[LLMEngine, list[list[int]], dict[tuple[int, ...], list[int]]]:
    """tiny-llama speculating with a `SpoilingProposer` over random prompts: the engine, the prompts and
    transformers' greedy continuation of each."""
    ref = hf_reference["tiny-llama"]
    prompts = random_prompts(num_prompts, ref.vocab_size, min_len, max_len, seed=seed)
    truth = {tuple(p): ref.greedy(p, NEW_TOKENS) for p in prompts}
    engine = speculative_engine(model_dirs["tiny-llama"], SpoilingProposer(truth, ref.vocab_size, spoil=spoil),
                                **engine_kwargs)
    return engine, prompts, truth


def assert_blocks_cover_only_computed_tokens(engine: LLMEngine) -> None:
    """A decoding sequence holds the blocks of its computed tokens and none that only rejected drafts
    used (the block of its newest token is taken by the step that computes it)."""
    bs = engine.config.block_size
    for seq in engine.scheduler.running:
        if seq.num_uncomputed_tokens == 1:
            assert len(seq.block_table) == -(-seq.num_computed_tokens // bs), seq.request_id


@pytest.mark.parametrize("arch", TEST_PRESETS)
def test_greedy_output_is_unchanged_by_verifying_drafts_in_every_family(model_dirs, hf_reference, arch):
    """Batched verification through every family's attention (windows, soft-capping, local/global
    layers), beside prompt chunks in the same step."""
    ref = hf_reference[arch]
    prompts = random_prompts(8, ref.vocab_size, 1, 120, seed=31)
    truth = {tuple(p): ref.greedy(p, NEW_TOKENS) for p in prompts}
    engine = speculative_engine(model_dirs[arch], SpoilingProposer(truth, ref.vocab_size, spoil=0.5),
                                max_num_batched_tokens=48)
    outputs = run_all(engine, prompts, GREEDY)
    assert [o.token_ids for o in outputs] == [truth[tuple(p)] for p in prompts]
    accepted = sum(o.num_accepted_tokens for o in outputs)
    assert 0 < accepted < sum(o.num_draft_tokens for o in outputs)
    assert_pool_idle(engine)


@pytest.mark.parametrize("seed", range(4))
def test_greedy_output_is_unchanged_over_random_batch_mixes(model_dirs, hf_reference, seed):
    """Random prompts sharing prefixes (prefix-cache hits), chunked prompt passes, lengths and draft
    sizes, in a pool small enough to preempt: no ragged-batch corruption, no block left behind."""
    arch = "tiny-llama"
    ref = hf_reference[arch]
    rng = random.Random(seed)
    prefixes = random_prompts(2, ref.vocab_size, 16, 40, seed=100 + seed)
    prompts = [rng.choice(prefixes + [[]]) + p for p in random_prompts(12, ref.vocab_size, 1, 90, seed=seed)]
    lengths = [rng.randint(1, 40) for _ in prompts]
    truth = {tuple(p): ref.greedy(p, n) for p, n in zip(prompts, lengths)}
    probe = LLMEngine(model_dirs[arch], EngineConfig(kv_memory_bytes=16 * 2**20))
    engine = speculative_engine(
        model_dirs[arch], SpoilingProposer(truth, ref.vocab_size, spoil=0.4, seed=seed), max_draft_tokens=8,
        max_model_len=256, kv_memory_bytes=(256 // 16 + 3) * probe.kv_layout.bytes_per_block,
        max_num_batched_tokens=40, prefill_chunk_size=rng.choice([7, 40]), max_num_seqs=6)
    ids = [engine.add_request(p, SamplingParams.greedy(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, lengths)]
    done = {}
    for _ in range(5_000):
        if not engine.has_unfinished_requests():
            break
        done.update({o.request_id: o for o in engine.step() if o.finished})
        assert_blocks_cover_only_computed_tokens(engine)
    assert [done[i].token_ids for i in ids] == [truth[tuple(p)] for p in prompts]
    assert engine.scheduler.num_preemptions > 0 and engine.pool.stats.hit_blocks > 0
    assert sum(o.num_accepted_tokens for o in done.values()) > 0
    assert_pool_idle(engine)


def test_seeded_sampling_is_unchanged_by_speculation(model_dirs):
    """A seeded request samples the same tokens with speculation as without, whatever its batch: each
    position is drawn from (seed, position) alone, so a draft token is accepted exactly when it is the
    token decoding one by one would have drawn there."""
    arch = "tiny-qwen2"
    prompts = random_prompts(10, 200, 3, 60, seed=5)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=i, max_tokens=NEW_TOKENS, ignore_eos=True)
              for i, (t, k, p) in enumerate([(1.0, 0, 1.0), (0.7, 20, 1.0), (1.3, 0, 0.9), (0.0, 0, 1.0)] * 3)][:10]
    plain = LLMEngine(model_dirs[arch], EngineConfig(kv_memory_bytes=16 * 2**20))
    truth = {tuple(p): o.token_ids for p, o in zip(prompts, run_all(plain, prompts, params))}
    engine = speculative_engine(model_dirs[arch], SpoilingProposer(truth, plain.vocab_size, spoil=0.5, seed=1))
    outputs = run_all(engine, prompts, params)
    assert [o.token_ids for o in outputs] == [truth[tuple(p)] for p in prompts]
    assert sum(o.num_accepted_tokens for o in outputs) > 0


def test_sampled_tokens_follow_the_target_distribution_when_drafts_are_verified(model_dirs, hf_reference):
    """A chi-square test over 3,000 seeded requests: the first two sampled tokens, the second always
    verified against a draft (the most likely token there), are distributed as the model says."""
    arch = "tiny-llama"
    top_k, draws = 4, 3000
    model = hf_reference[arch].model
    prompt = random_prompts(1, hf_reference[arch].vocab_size, 12, 12, seed=9)[0]

    def top_probs(tokens: list[int]) -> dict[int, float]:
        with torch.inference_mode():
            logits = model(torch.tensor([tokens])).logits[0, -1].double()
        values, ids = logits.topk(top_k)
        return dict(zip(ids.tolist(), torch.softmax(values, -1).tolist()))

    first = top_probs(prompt)
    second = {t0: top_probs(prompt + [t0]) for t0 in first}
    expected = {(t0, t1): p0 * p1 for t0, p0 in first.items() for t1, p1 in second[t0].items()}
    likeliest = {t0: max(probs, key=probs.get) for t0, probs in second.items()}

    class Likeliest:
        def propose(self, requests: list[DraftRequest], worth: DraftWorth) -> list[Draft]:
            return [Draft([likeliest[r.seq.output_token_ids[0]]], [0.5]) if len(r.seq.output_token_ids) == 1
                    else Draft() for r in requests]

        def verified(self, seq: Sequence, draft: list[int], accepted: int) -> None:
            pass

        def finished(self, seq: Sequence) -> None:
            pass

    engine = speculative_engine(model_dirs[arch], Likeliest(), max_num_seqs=128)
    params = [SamplingParams(top_k=top_k, seed=s, max_tokens=3, ignore_eos=True) for s in range(draws)]
    outputs = run_all(engine, [prompt] * draws, params)
    assert sum(o.num_draft_tokens for o in outputs) == draws
    counts = {cell: 0 for cell in expected}
    for o in outputs:
        counts[tuple(o.token_ids[:2])] += 1
    chi2 = sum((counts[c] - draws * p) ** 2 / (draws * p) for c, p in expected.items())
    assert chi2 < 37.70, (chi2, counts)  # the 0.999 quantile of chi-square with 15 degrees of freedom
    accepted = sum(o.num_accepted_tokens for o in outputs) / draws
    assert accepted == pytest.approx(sum(first[t0] * second[t0][likeliest[t0]] for t0 in first), abs=0.05)


def test_heavy_rejection_frees_every_block_and_caches_only_accepted_tokens(model_dirs, hf_reference):
    engine, prompts, truth = spoiled_run(model_dirs, hf_reference, 6, 20, 70, seed=12, spoil=1.0, max_draft_tokens=8)
    outputs = run_all(engine, prompts, GREEDY)
    assert [o.token_ids for o in outputs] == [truth[tuple(p)] for p in prompts]
    assert_pool_idle(engine)
    bs = engine.config.block_size
    true_blocks = {h for p, o in zip(prompts, outputs) for h in hash_prompt_blocks((p + o.token_ids)[:-1], bs)}
    assert engine.pool.cached_hashes() and set(engine.pool.cached_hashes()) <= true_blocks


def test_a_request_can_turn_speculation_off_for_itself(model_dirs, hf_reference):
    engine, prompts, truth = spoiled_run(model_dirs, hf_reference, 4, 20, 40, seed=15, spoil=0.0)
    params = [SamplingParams.greedy(max_tokens=NEW_TOKENS, ignore_eos=True, speculative=i % 2 == 0) for i in range(4)]
    outputs = run_all(engine, prompts, params)
    assert [o.token_ids for o in outputs] == [truth[tuple(p)] for p in prompts]
    assert [o.num_draft_tokens > 0 for o in outputs] == [True, False, True, False]


def test_rows_verifying_drafts_are_attended_apart_from_one_token_rows(model_dirs, hf_reference, monkeypatch):
    """One request verifying drafts beside requests decoding one token each: the latter stay a batch
    of one query per row (padded to the draft's length, each would read its context once per padded
    query), and the output is unchanged."""
    import pdserve.engine.attention as attention

    ref = hf_reference["tiny-llama"]
    prompts = random_prompts(4, ref.vocab_size, 20, 40, seed=16)
    truth = {tuple(p): ref.greedy(p, NEW_TOKENS) for p in prompts}

    class FirstRequestDrafts(SpoilingProposer):  # the first request's true next tokens, as many as it may
        def propose(self, requests, worth):
            drafts = [self.truth[first][len(r.seq.output_token_ids):][: r.max_tokens]
                      if tuple(r.seq.prompt_token_ids) == first else [] for r in requests]
            return [Draft(tokens, [1.0] * len(tokens)) for tokens in drafts]

    first = tuple(prompts[0])
    batches: list[tuple[int, int]] = []  # (rows, queries) of each decode batch attended
    attend = attention._attend

    def recording(q, k, v, mask, scale, softcap):
        if mask is not None and mask.dim() == 4 and q.shape[0] == mask.shape[0]:
            batches.append((q.shape[0], q.shape[2]))
        return attend(q, k, v, mask, scale, softcap)

    monkeypatch.setattr(attention, "_attend", recording)
    engine = speculative_engine(model_dirs["tiny-llama"], FirstRequestDrafts(truth, ref.vocab_size, 0.0),
                                max_draft_tokens=6)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()  # the prompt passes
    batches.clear()
    engine.step()  # the first request's first draft, every request decoding
    assert set(batches) == {(3, 1), (1, 7)}
    outputs = drain(engine, ids)
    assert [o.token_ids for o in outputs] == [truth[tuple(p)] for p in prompts]
    assert engine.decode_step_shape.tokens_per_seq > 1  # what the worker reports to the router
    assert_pool_idle(engine)


def test_a_request_aborted_between_verifying_steps_frees_everything(model_dirs, hf_reference):
    engine, prompts, _ = spoiled_run(model_dirs, hf_reference, 4, 30, 60, seed=14, spoil=0.5, max_draft_tokens=8)
    ids = [engine.add_request(p, SamplingParams.greedy(max_tokens=100, ignore_eos=True)) for p in prompts]
    engine.step()  # the prompt passes
    for request_id in ids:  # each aborted after one more verifying step, the rest still running
        engine.step()
        assert engine.requests[request_id].num_draft_tokens > 0
        assert engine.abort_request(request_id)
    assert_pool_idle(engine)


# --- the suffix proposer ------------------------------------------------------------------------
CONFIG = SpeculativeConfig(max_match=8, max_spec_factor=2.0, min_token_prob=0.3, recent_output_tokens=64)


def index_of(tokens: list[int]) -> TokenIndex:
    index = TokenIndex()
    index.extend(tokens)
    return index


def test_the_suffix_index_follows_the_longest_earlier_match():
    tokens = [1, 2, 3, 4, 5, 9, 9, 7, 2, 3, 6, 9, 9, 1, 2, 3]  # "2 3" twice before the end, "1 2 3" once
    draft = index_of(tokens).draft(tokens, 8, CONFIG)
    assert draft.tokens == [4, 5, 9, 9, 7, 2]  # what followed "1 2 3", up to 2 x its 3 tokens
    assert draft.expected == pytest.approx(6.0)


def test_the_suffix_draft_takes_the_most_frequent_path_and_stops_where_it_is_unlikely():
    tokens = [5, 6, 7, 5, 6, 7, 5, 6, 8, 5, 6]  # after "5 6": 7 twice, 8 once
    draft = index_of(tokens).draft(tokens, 8, CONFIG)
    assert draft.tokens[0] == 7
    assert draft.expected > 0.6


def test_the_suffix_draft_is_bounded_by_its_match_and_the_limit():
    tokens = list(range(10, 30)) + [10]
    assert index_of(tokens).draft(tokens, 8, CONFIG).tokens == [11, 12]  # a match of 1: 2x1 tokens
    long = list(range(10, 30)) + list(range(10, 16))
    assert index_of(long).draft(long, 5, CONFIG).tokens == [16, 17, 18, 19, 20]
    assert index_of([1, 2, 3]).draft([1, 2, 3], 8, CONFIG).tokens == []  # nothing seen twice


def test_recent_outputs_help_other_requests_and_stay_bounded():
    proposer = SuffixProposer(CONFIG)
    done = Sequence("a", [3, 3], GREEDY, output_token_ids=[40, 41, 42, 43, 44, 45])
    proposer.finished(done)
    asking = Sequence("b", [7, 40, 41, 42], GREEDY)
    assert proposer.propose_one(asking, 8).tokens == [43, 44, 45]  # matched "40 41 42" in the other's output
    recent = RecentOutputs(capacity=10)
    for i in range(50):
        recent.add([i] * 4)
    assert len(recent.index.tokens) <= 2 * 10 + 5
    assert 49 in recent.index.where and 0 not in recent.index.where


def test_the_suffix_proposer_speeds_up_repetitive_text_without_changing_it(model_dirs, hf_reference):
    arch = "tiny-llama"
    ref = hf_reference[arch]
    prompts = [p * 4 for p in random_prompts(4, ref.vocab_size, 6, 12, seed=2)]  # patterns the model continues
    expected = [ref.greedy(p, 40) for p in prompts]
    params = SamplingParams.greedy(max_tokens=40, ignore_eos=True)
    engine = speculative_engine(model_dirs[arch], max_draft_tokens=8)
    steps = 0
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        steps += 1
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert [done[i].token_ids for i in ids] == expected
    assert steps < 40 and sum(o.num_accepted_tokens for o in done.values()) > 0
    assert_pool_idle(engine)


# --- draft lengths sized by goodput ---------------------------------------------------------------
def candidate(p: float = 0.5, acceptance: float = 1.0, max_tokens: int = 8, context_len: int = 100) -> DraftCandidate:
    """A draft each of whose tokens is accepted with chance `p` after the one before it."""
    return DraftCandidate(context_len, [p ** (j + 1) for j in range(max_tokens)], acceptance)


def test_each_draft_token_is_verified_only_while_it_raises_the_steps_goodput():
    # A request accepting each draft token with chance 1/2, a step of fixed cost a and b per token: one
    # draft token takes the step from 1 token in a + b to 1.5 in a + 2b, the second to 1.75 in a + 3b.
    assert draft_lengths([candidate()], DecodeCost(a=1.0, b=1.0)) == [0]  # 1.5 / 3 is not above 1 / 2
    assert draft_lengths([candidate()], DecodeCost(a=3.0, b=1.0)) == [1]  # 1.5 / 5 > 1 / 4, but 1.75 / 6 < 1.5 / 5
    assert draft_lengths([candidate()], DecodeCost(a=1.0)) == [8]  # tokens cost nothing: every draft pays
    assert draft_lengths([candidate(p=1.0, acceptance=0.2)], DecodeCost(a=3.0, b=1.0)) == [0]  # a poor record


def test_drafts_are_long_in_small_batches_short_in_token_bound_ones_and_none_where_they_keep_failing():
    fixed_cost = DecodeCost(a=5e-3, b=2e-5, c=1e-9)  # a CPU decode step: its fixed cost dominates
    assert draft_lengths([candidate(p=0.75)], fixed_cost) == [8]
    big_batch = draft_lengths([candidate(p=0.75)] * 64, fixed_cost, other_tokens=1500)
    assert max(big_batch) < 8
    assert draft_lengths([candidate()] * 4, DecodeCost(b=1e-3)) == [0] * 4  # bound by its tokens: none pays
    good, bad = draft_lengths([candidate(p=0.9), candidate(p=0.9, acceptance=0.05)], DecodeCost(a=2e-3, b=1e-4))
    assert good > bad
    assert draft_lengths([candidate(max_tokens=3)], DecodeCost()) == [3]  # no measurement yet: drafts whole


def test_a_step_verifies_drafts_only_where_they_pay_for_verifying_at_all():
    # Verifying costs 2 on a step of 4 (one token per sequence runs as a matrix-vector product, more
    # as matrix products): a draft expected to add 0.43 tokens does not pay for it, eight sure tokens do.
    premium = DecodeCost(a=4.0, b=0.01, verify=2.0)
    assert draft_lengths([candidate(p=0.3)], premium) == [0]
    assert draft_lengths([candidate(p=1.0)], premium) == [8]
    assert draft_lengths([candidate(p=0.3)], DecodeCost(a=4.0, b=0.01)) != [0]  # no premium: it pays


def test_a_requests_record_starts_from_the_engines_and_fades():
    record = AcceptanceRecord(decay=0.5)
    assert record.rate(prior=0.8) == pytest.approx(0.8)  # no record: the prior
    for _ in range(5):
        record.observe(accepted=0, rejected=True)
    assert record.rate(prior=0.8) < 0.3  # its drafts failed: short drafts, or none
    for _ in range(10):  # steps without drafts: the failures fade, and the prior comes back
        record.tick()
    assert record.rate(prior=0.8) > 0.79
    record.observe(accepted=20, rejected=True)
    assert record.rate(prior=0.1) > 0.8  # accepted run after run: believed


def test_a_draft_token_is_worth_what_the_proposer_says_but_no_more_than_the_record_allows():
    sure = DraftCandidate(100, [1.0, 1.0, 1.0], acceptance=0.5)  # a confident proposer, a poor record
    assert [sure.gain(j) for j in (1, 2, 3)] == [0.5, 0.25, 0.125]
    unsure = DraftCandidate(100, [0.3, 0.1], acceptance=0.9)
    assert [unsure.gain(j) for j in (1, 2)] == [0.3, 0.1]


def test_goodput_sized_speculation_keeps_outputs_exact(model_dirs, hf_reference):
    engine, prompts, truth = spoiled_run(model_dirs, hf_reference, 12, 5, 80, seed=41, spoil=0.5, max_draft_tokens=8,
                                         goodput_sizing=True)
    engine.decode_step_costs.add_profile([(1, 101, False, 1, 101, 5e-3), (2, 204, True, 1, 102, 6e-3),  # to start from
                                          (9, 900, True, 1, 100, 7e-3), (8, 800, False, 8, 800, 8e-3),
                                          (16, 1600, True, 8, 800, 9e-3), (32, 3200, False, 32, 3200, 12e-3)])
    assert engine.decode_step_costs.profiled
    outputs = run_all(engine, prompts, GREEDY)
    assert [o.token_ids for o in outputs] == [truth[tuple(p)] for p in prompts]
    assert_pool_idle(engine)


def test_steps_served_rescale_the_profiled_decode_cost_without_refitting_its_shape():
    """Served steps come in few shapes (one batch size for a while): they scale the profile's fit, and
    never trade one of its coefficients for another."""
    true = DecodeCost(a=4e-3, b=1e-4, verify=1e-3, per_seq=2e-4)
    model = DecodeCostModel()
    model.add_profile([(b * (1 + k), 0, k > 0, b, 0, true.step_s(b * (1 + k), 0, k > 0, b))
                       for b in (1, 8, 32) for k in (0, 1, 4, 8)])
    assert model.cost.step_s(8, 0, False, 8) == pytest.approx(true.step_s(8, 0, False, 8), rel=1e-3)
    for _ in range(300):  # a loaded machine: every step, all of one shape, twice as slow
        model.observe(8, 0, False, 8, 0, 2 * true.step_s(8, 0, False, 8))
    assert model.cost.verify / model.cost.a == pytest.approx(true.verify / true.a, rel=1e-3)
    assert model.cost.step_s(1, 0, True, 1) == pytest.approx(2 * true.step_s(1, 0, True, 1), rel=0.01)


def test_a_profile_sample_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match="5 features and the seconds"):
        DecodeCostModel().add_profile([(1, 101, False, 1, 5e-3)])

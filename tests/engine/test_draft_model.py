"""The draft-model proposer: a small model beside the target drafts through its own paged KV, and the
output stays the target's, token for token; the recipe that makes a draft runs; the shipped draft
agrees with its target on text neither saw."""

from __future__ import annotations

import json
import random

import pytest
import torch
from helpers import assert_pool_idle, random_prompts
from transformers import AutoTokenizer, LlamaForCausalLM

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.models.draft_training import DraftConfig, agreement, draft_from_target, train_draft
from pdserve.engine.models.presets import resolve_model
from pdserve.engine.models.training import RECIPE_FILE, heldout_text
from pdserve.engine.speculative.config import SpeculativeConfig
from pdserve.engine.profiler import DECODE_BATCHES, profile_decode
from pdserve.engine.speculative.draft import AcceptanceRecord, DraftRequest, DraftWorth, WorkerRecord
from pdserve.engine.speculative.draft_model import DraftModelProposer, GuessCalibration
from pdserve.engine.speculative.proposer import SuffixThenModel

ARCH = "tiny-llama"


def draft_engine(model_dirs, draft_dir, method: str = "draft_model", **kwargs) -> LLMEngine:
    kwargs.setdefault("kv_memory_bytes", 16 * 2**20)
    spec = SpeculativeConfig(method=method, draft_model=str(draft_dir), max_draft_tokens=6, min_token_prob=0.0,
                             goodput_sizing=False)
    return LLMEngine(model_dirs[ARCH], EngineConfig(speculative=spec, **kwargs))


def draft_proposer(engine: LLMEngine) -> DraftModelProposer:
    proposer = engine.proposer
    return proposer.model if isinstance(proposer, SuffixThenModel) else proposer


def run_checked(engine: LLMEngine, prompts: list[list[int]], lengths: list[int]) -> dict[str, object]:
    """Step until every request finishes (bounded); outputs by request id, in the order added."""
    ids = [engine.add_request(p, SamplingParams.greedy(max_tokens=n, ignore_eos=True))
           for p, n in zip(prompts, lengths)]
    done = {}
    for _ in range(5_000):
        if not engine.has_unfinished_requests():
            break
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return {i: done[i] for i in ids}


def assert_draft_pool_idle(engine: LLMEngine) -> None:
    proposer = draft_proposer(engine)
    assert proposer.pool.num_free == proposer.pool.num_blocks and not proposer._states


def test_a_draft_model_that_is_the_target_has_its_greedy_drafts_accepted(model_dirs, hf_reference):
    """The target as its own draft: its drafts are what the target decodes, so (up to float rounding
    between batch shapes) all are accepted, which only holds when the draft's KV is kept exactly across
    steps, chunked prompts and prefix hits."""
    ref = hf_reference[ARCH]
    prefix = random_prompts(1, ref.vocab_size, 40, 40, seed=3)[0]
    prompts = [prefix + p for p in random_prompts(6, ref.vocab_size, 1, 60, seed=4)]
    engine = draft_engine(model_dirs, model_dirs[ARCH], max_num_batched_tokens=48)
    outputs = list(run_checked(engine, prompts, [30] * len(prompts)).values())
    assert [o.token_ids for o in outputs] == [ref.greedy(p, 30) for p in prompts]
    drafted, accepted = sum(o.num_draft_tokens for o in outputs), sum(o.num_accepted_tokens for o in outputs)
    assert drafted > 100 and accepted >= 0.97 * drafted
    calibration = draft_proposer(engine).calibration  # learned from the verifications: its guesses are taken
    assert max(calibration.chance(p, prior=0.0) for p in (0.01, 0.07, 0.15, 0.3, 0.5, 0.8)) > 0.9
    assert engine.pool.stats.hit_blocks > 0
    assert_pool_idle(engine)
    assert_draft_pool_idle(engine)


@pytest.mark.parametrize("method,seed", [("draft_model", 0), ("draft_model", 1), ("both", 2)])
def test_a_draft_model_keeps_greedy_output_exact_over_random_batch_mixes(model_dirs, hf_reference, tiny_llama_draft,
                                                                         method, seed):
    """An untrained one-layer draft (accepted in part) over prompts sharing prefixes, chunked prompt
    passes and a pool small enough to preempt: the target's output, and both pools empty after."""
    ref = hf_reference[ARCH]
    rng = random.Random(seed)
    prefixes = random_prompts(2, ref.vocab_size, 16, 40, seed=100 + seed)
    prompts = [rng.choice(prefixes + [[]]) + p for p in random_prompts(10, ref.vocab_size, 1, 90, seed=seed)]
    if method == "both":  # text that repeats itself, for the suffix proposer's part
        prompts[:3] = [p[:8] * 5 for p in prompts[:3]]
    lengths = [rng.randint(1, 40) for _ in prompts]
    probe = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=16 * 2**20))
    engine = draft_engine(model_dirs, tiny_llama_draft, method, max_model_len=256, max_num_seqs=6,
                          kv_memory_bytes=(256 // 16 + 3) * probe.kv_layout.bytes_per_block,
                          max_num_batched_tokens=40, prefill_chunk_size=rng.choice([7, 40]))
    outputs = list(run_checked(engine, prompts, lengths).values())
    assert [o.token_ids for o in outputs] == [ref.greedy(p, n) for p, n in zip(prompts, lengths)]
    assert engine.scheduler.num_preemptions > 0
    drafted, accepted = sum(o.num_draft_tokens for o in outputs), sum(o.num_accepted_tokens for o in outputs)
    assert 0 < accepted < drafted
    assert_pool_idle(engine)
    assert_draft_pool_idle(engine)


def test_a_request_aborted_mid_draft_frees_its_draft_kv(model_dirs, hf_reference, tiny_llama_draft):
    prompts = random_prompts(3, hf_reference[ARCH].vocab_size, 20, 50, seed=8)
    engine = draft_engine(model_dirs, tiny_llama_draft)
    ids = [engine.add_request(p, SamplingParams.greedy(max_tokens=100, ignore_eos=True)) for p in prompts]
    engine.step()
    for request_id in ids:
        engine.step()
        assert draft_proposer(engine)._states
        assert engine.abort_request(request_id)
    assert_pool_idle(engine)
    assert_draft_pool_idle(engine)


def test_a_draft_model_must_share_the_targets_tokenizer(model_dirs):
    with pytest.raises(ValueError, match="needs draft_model"):
        SpeculativeConfig(method="both")
    with pytest.raises(ValueError, match="takes no draft_model"):
        SpeculativeConfig(method="suffix", draft_model="pystd-llama-draft")
    with pytest.raises(ValueError, match="does not have the target's tokenizer"):
        draft_engine(model_dirs, "pystd-llama-draft")


def test_the_draft_recipe_runs_from_the_targets_first_layer(model_dirs, tmp_path):
    tiny = DraftConfig(steps=2, seq_len=32, batch_size=2, warmup_steps=1, eval_tokens=64, max_train_chars=20_000,
                       threads=1)
    results = train_draft(model_dirs[ARCH], tiny, tmp_path / "draft", progress=False)
    draft = LlamaForCausalLM.from_pretrained(tmp_path / "draft")
    assert draft.config.num_hidden_layers == 1 and draft.dtype == torch.float16
    recipe = json.loads((tmp_path / "draft" / RECIPE_FILE).read_text())
    assert recipe["results"]["after"] == results["after"] and 0 <= results["after"]["greedy_agreement"] <= 1
    with pytest.raises(ValueError, match="a draft has 1 to 1 layers"):
        draft_from_target(LlamaForCausalLM.from_pretrained(model_dirs[ARCH]), 2)


def test_the_shipped_draft_agrees_with_its_target_on_held_out_source():
    target_dir, draft_dir = resolve_model("pystd-llama"), resolve_model("pystd-llama-draft")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    assert AutoTokenizer.from_pretrained(draft_dir).get_vocab() == tokenizer.get_vocab()
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = LlamaForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    stream = torch.tensor(tokenizer.encode(heldout_text(20_000), add_special_tokens=False))
    scores = agreement(draft, target, stream, seq_len=512, max_tokens=4096)
    assert scores["greedy_agreement"] > 0.5 and scores["sampled_acceptance"] > 0.5, scores


def test_a_request_picks_one_proposer_where_the_deployment_runs_both(model_dirs, hf_reference, tiny_llama_draft):
    prompts = random_prompts(3, hf_reference[ARCH].vocab_size, 20, 30, seed=11)
    engine = draft_engine(model_dirs, tiny_llama_draft, "both")
    picks = {engine.add_request(p, SamplingParams.greedy(max_tokens=12, ignore_eos=True, proposer=pick)): pick
             for p, pick in zip(prompts, ["suffix", "draft_model", None])}
    engine.step()  # the prompt passes
    engine.step()  # the first drafts
    drafted_by_model = set(draft_proposer(engine)._states)
    assert {rid for rid, pick in picks.items() if pick == "draft_model"} <= drafted_by_model
    assert not {rid for rid, pick in picks.items() if pick == "suffix"} & drafted_by_model
    with pytest.raises(ValueError, match="proposer must be one of suffix, draft_model"):
        SamplingParams(proposer="medusa")


def test_the_draft_model_runs_only_while_its_tokens_are_worth_its_passes(model_dirs, hf_reference, tiny_llama_draft):
    """A pass costs its measured time whatever it yields: none runs where the tokens it is expected to
    add (chance times what a token saves) are worth less than it (the first: and than verifying), and
    none for a request whose drafts fail."""
    engine = draft_engine(model_dirs, tiny_llama_draft)
    engine.add_request(random_prompts(1, hf_reference[ARCH].vocab_size, 30, 30, seed=2)[0],  # sampled: each
                       SamplingParams(temperature=1.0, seed=0, max_tokens=50, ignore_eos=True))  # guess is worth p
    engine.step()
    seq = next(iter(engine.requests.values()))
    proposer = draft_proposer(engine)
    for _ in range(16):  # a refit's worth of passes of a second each
        proposer.pass_cost.observe(1, 1, 1.0)
    assert proposer.pass_cost.seconds(1, 1) == pytest.approx(1.0)
    sure, failing = DraftRequest(seq, 4, acceptance=0.9), DraftRequest(seq, 4, acceptance=0.01)
    assert len(proposer.propose([sure], DraftWorth())[0].tokens) == 4  # no value known: drafts whole
    # The first pass is worth 0.9 x 10 s; the second too little, the untrained draft unsure of its guess.
    first = proposer.propose([sure], DraftWorth(10.0))[0]
    assert len(first.tokens) == 1 and first.probabilities[0] * 0.9 * 10.0 < 1.0
    assert proposer.propose([sure], DraftWorth(0.5))[0].tokens == []  # 0.9 tokens x 0.5 s < 1 s
    assert proposer.propose([sure], DraftWorth(10.0, verify_s=9.0))[0].tokens == []  # 9 s < 1 s + 9 s
    assert proposer.propose([failing], DraftWorth(10.0))[0].tokens == []  # 0.01 x 10 s < 1 s


def test_a_requests_first_pass_counts_what_its_short_record_may_be_off_by(model_dirs, hf_reference,
                                                                          tiny_llama_draft):
    """One failed verification is mostly luck: a step's first pass, not worth it at the record's rate,
    still runs while the record is that young (its rate plus one standard error), and no longer once
    failures pile up."""
    engine = draft_engine(model_dirs, tiny_llama_draft)
    engine.add_request(random_prompts(1, hf_reference[ARCH].vocab_size, 30, 30, seed=3)[0],
                       SamplingParams(temperature=1.0, seed=0, max_tokens=50, ignore_eos=True))
    engine.step()
    seq = next(iter(engine.requests.values()))
    proposer = draft_proposer(engine)
    for _ in range(16):  # a refit's worth of passes of a second each
        proposer.pass_cost.observe(1, 1, 1.0)
    young, old = AcceptanceRecord(decay=1.0), AcceptanceRecord(decay=1.0)
    young.observe(accepted=0, rejected=True)
    for _ in range(20):
        old.observe(accepted=0, rejected=True)
    worth = DraftWorth(token_s=1.5)  # at 0.53 a token, a first pass is worth 0.8 s: less than it costs
    assert young.rate(prior=0.8) * worth.token_s < 1.0 < (young.rate(0.8) + young.uncertainty(0.8)) * worth.token_s
    as_sure = DraftRequest(seq, 4, acceptance=young.rate(prior=0.8))
    assert proposer.propose([as_sure], worth)[0].tokens == []
    hopeful = DraftRequest(seq, 4, acceptance=young.rate(prior=0.8), uncertainty=young.uncertainty(prior=0.8))
    assert proposer.propose([hopeful], worth)[0].tokens
    failing = DraftRequest(seq, 4, acceptance=old.rate(prior=0.8), uncertainty=old.uncertainty(prior=0.8))
    assert proposer.propose([failing], worth)[0].tokens == []


def test_the_decode_profile_times_draft_passes_that_feed_several_tokens(model_dirs, tiny_llama_draft):
    """Passes while serving mostly feed one token per sequence, which cannot tell a token's cost from a
    sequence's: the profile's passes anchor the fit with first passes' several tokens too."""
    engine = draft_engine(model_dirs, tiny_llama_draft, max_model_len=256)
    profile_decode(engine, contexts=(32,))
    proposer = draft_proposer(engine)
    assert proposer.pass_cost.profiled
    fed = {(seqs, tokens // seqs) for seqs, tokens, _ in proposer.pass_cost._anchors}
    assert fed == {(batch, n) for batch in DECODE_BATCHES for n in (1, proposer.config.max_draft_tokens + 1)}
    assert_draft_pool_idle(engine)


def test_greedy_and_sampled_requests_keep_separate_worker_records():
    record = WorkerRecord(decay=1.0)
    greedy, sampled = SamplingParams.greedy(), SamplingParams(temperature=1.0)
    for _ in range(20):
        record.of(sampled).observe(accepted=0, rejected=True)
    assert record.of(sampled).rate(prior=0.8) < 0.1 and record.of(greedy).rate(prior=0.8) == pytest.approx(0.8)


def test_a_greedy_guess_is_worth_what_guesses_as_likely_under_the_draft_were_worth():
    calibration = GuessCalibration()
    assert calibration.chance(0.3, prior=0.8) == pytest.approx(0.8)  # nothing verified yet: the prior
    for _ in range(50):
        calibration.observe(0.3, accepted=True)
        calibration.observe(0.02, accepted=False)
    assert calibration.chance(0.25, prior=0.5) > 0.95 and calibration.chance(0.01, prior=0.5) < 0.05
    assert calibration.chance(0.9, prior=0.5) == pytest.approx(0.5)  # another bin: still the prior


def test_a_drafts_kv_identity_names_its_weights_not_only_its_name(model_dirs, tiny_llama_draft, tmp_path):
    """A draft of the same name with other weights (retrained on another node, say) offers KV that is
    not this draft's: the identity a transfer's sides compare tells them apart."""
    import shutil

    other = tmp_path / "retrained"
    shutil.copytree(tiny_llama_draft, other)
    model = LlamaForCausalLM.from_pretrained(other, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    model.save_pretrained(other)
    target = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=4 * 2**20))
    named = SpeculativeConfig(method="draft_model", draft_model="the-draft")

    def identity(draft_dir) -> str:
        return DraftModelProposer(named, draft_dir, torch.float32, "cpu", 16, 8, target.tokenizer.get_vocab(),
                                  target.vocab_size, target.max_model_len, 64).kv_identity

    assert identity(tiny_llama_draft) == identity(tiny_llama_draft)
    assert identity(tiny_llama_draft) != identity(other)

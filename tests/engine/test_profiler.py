"""The start-up profile on an engine that already holds requests (a worker restarted under load), and
on one given a stored profile's costs."""

from __future__ import annotations

import pytest
from helpers import random_prompts
from helpers import assert_pool_idle, drain

from pdserve.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from pdserve.engine.block_pool import hash_prompt_blocks
from pdserve.engine.cost_model import StepCost
from pdserve.engine.profiler import DECODE_BATCHES, DECODE_CONTEXTS, DRAFT_LENGTHS, profile_decode, profile_prefill
from pdserve.engine.speculative.config import SpeculativeConfig

ARCH = "tiny-llama"


class RecordingListener:
    """The cache as a KV event subscriber would see it, from the pool's events alone."""

    def __init__(self) -> None:
        self.view: set[bytes] = set()

    def stored(self, block_hash: bytes, parent_hash: bytes | None) -> None:
        self.view.add(block_hash)

    def removed(self, block_hash: bytes) -> None:
        self.view.discard(block_hash)


def test_the_profile_serves_the_requests_the_engine_already_holds(model_dirs, hf_reference):
    """Requests in the engine when the profile starts go on decoding: every output reaches the
    callback, the tokens are exact, the listener hears of their blocks and of none of the profile's,
    and the profile leaves no block of its own behind."""
    engine = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=16 * 2**20))
    listener = engine.pool.listener = RecordingListener()
    prompts = random_prompts(3, hf_reference[ARCH].vocab_size, 40, 90, seed=11)
    params = SamplingParams.greedy(max_tokens=6, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    outputs: list[RequestOutput] = engine.step()  # under way when the profile starts
    lengths = (8, 16, 32, 64, 128)  # the first prompts share steps with the requests, the last run alone
    profile = profile_prefill(engine, outputs.extend, lengths=lengths)
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        outputs += engine.step()
    streamed = {i: [t for out in outputs if out.request_id == i for t in out.new_token_ids] for i in ids}
    expected = [hf_reference[ARCH].greedy(p, 6) for p in prompts]
    assert [streamed[i] for i in ids] == expected  # every token reached the callback, exact
    assert sorted(out.request_id for out in outputs if out.finished) == sorted(ids)
    assert profile.samples and all(tokens in lengths for tokens, _, _ in profile.samples), profile  # alone
    assert not profile.complete  # the worker profiles again
    theirs = {h for p, i in zip(prompts, ids) for h in hash_prompt_blocks(p + streamed[i], engine.config.block_size)}
    assert listener.view == set(engine.pool.cached_hashes()) and listener.view <= theirs
    assert_pool_idle(engine)


def test_the_profile_gives_up_a_prompt_that_held_blocks_leave_no_room_for(model_dirs, hf_reference):
    """A held request (a prefill worker's, waiting for its transfer) is released only by a command of
    the engine loop, which does not run during the profile: a prompt that cannot fit beside it is
    given up instead of waiting forever, and the held request is untouched."""
    probe = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=16 * 2**20))
    block_size = probe.config.block_size
    engine = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=10 * probe.kv_layout.bytes_per_block,
                                                      max_model_len=10 * block_size))
    [prompt] = random_prompts(1, hf_reference[ARCH].vocab_size, 7 * block_size, 7 * block_size, seed=12)
    held = engine.add_request(prompt, SamplingParams.greedy(max_tokens=16), prefill_only=True)
    drain(engine, [held])
    free_before = engine.pool.num_free
    profile = profile_prefill(engine, lambda outputs: None, lengths=(8, 8 * block_size))
    assert [tokens for tokens, _, _ in profile.samples] == [8] and not profile.complete  # the long one never ran
    assert list(engine.requests) == [held] and engine.pool.num_free == free_before
    engine.release(held)
    assert_pool_idle(engine)


def test_an_engine_given_a_stored_profiles_costs_starts_from_them_after_one_warm_up_pass(model_dirs):
    stored = StepCost(a=0.004, b=2e-5, c=3e-9)
    engine = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=16 * 2**20, stored_step_cost=stored))
    profile = profile_prefill(engine, lambda outputs: None, lengths=(8, 32, 128))
    assert profile.complete and profile.samples == [(n, n * n, stored.prefill_s(n)) for n in (8, 32, 128)]
    assert engine.last_step.num_tokens == 8  # the one pass that ran: the shortest, a warm-up
    fitted = engine.step_costs.coefficients  # the warm-up's own time is not among what it was fitted to
    assert [fitted.a, fitted.b, fitted.c] == pytest.approx([stored.a, stored.b, stored.c], rel=1e-6)
    assert_pool_idle(engine)


def test_the_decode_profile_measures_steps_verifying_each_draft_length_and_leaves_the_pool_idle(model_dirs):
    engine = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=16 * 2**20, speculative=SpeculativeConfig()))
    proposer, record = engine.proposer, engine.acceptance.greedy.rate(prior=0.5)
    samples = profile_decode(engine)
    assert {tokens for tokens, *_ in samples} == {b * (1 + k) for b in DECODE_BATCHES for k in DRAFT_LENGTHS}
    single = [keys for tokens, quad, _, _, keys, _ in samples if tokens == 1]  # one sequence, short and long contexts
    assert min(single) < DECODE_CONTEXTS[0] + 20 and max(single) > DECODE_CONTEXTS[1]
    # the KV read is each sequence's context once, whatever it verifies; the arithmetic grows with the queries
    assert all(quad >= keys * (tokens // seqs) for tokens, quad, _, seqs, keys, _ in samples)
    assert engine.decode_step_costs.cost.measured
    assert engine.proposer is proposer and engine.config.speculative.goodput_sizing  # put back
    assert engine.acceptance.greedy.rate(prior=0.5) == record  # its rejected drafts say nothing of requests'
    assert engine.decode_step_shape.tokens_per_seq == 1.0  # nor of what their steps verify
    assert_pool_idle(engine)
    assert engine.pool.num_cached == 0  # its prompts' blocks forgotten
    busy = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=16 * 2**20, speculative=SpeculativeConfig()))
    busy.add_request([5] * 20, SamplingParams.greedy(max_tokens=4))
    assert profile_decode(busy) == [] and not busy.decode_step_costs.cost.measured
    plain = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=16 * 2**20))
    assert {tokens for tokens, *_ in profile_decode(plain)} == set(DECODE_BATCHES)  # no drafts: plain steps

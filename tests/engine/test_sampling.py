"""Sampling: seeded reproducibility independent of the batch, filters, stop conditions, logprobs."""

from __future__ import annotations

import pytest
import torch
from helpers import random_prompts
from helpers import assert_pool_idle, run_all

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams

ARCH = "tiny-llama"


@pytest.fixture()
def engine(model_dirs) -> LLMEngine:
    return LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=16 * 2**20))


@pytest.fixture(scope="module")
def prompts(hf_reference):
    return random_prompts(12, hf_reference[ARCH].vocab_size, 3, 120, seed=21)


def test_seeded_sampling_same_alone_or_in_a_batch(engine, prompts):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = run_all(engine, [prompts[0]], seeded)[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=7 + i, ignore_eos=True) for i in range(len(prompts) - 1)]
    batched = run_all(engine, prompts, [seeded, *others])
    assert batched[0].token_ids == alone
    # Different seeds give different samples (the seed is actually used).
    other_seed = run_all(engine, [prompts[0]], SamplingParams(**{**seeded.__dict__, "seed": 99}))[0].token_ids
    assert other_seed != alone
    assert_pool_idle(engine)


def test_seeded_sampling_survives_preemption(model_dirs, prompts):
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=30, ignore_eos=True)
    roomy = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=16 * 2**20, max_model_len=256))
    bytes_per_block = roomy.kv_layout.bytes_per_block
    tight = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=18 * bytes_per_block, max_model_len=256))
    a = run_all(roomy, prompts, seeded)
    b = run_all(tight, prompts, seeded)
    assert tight.scheduler.num_preemptions > 0
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_top_k_1_and_tiny_top_p_are_greedy(engine, prompts, hf_reference):
    greedy = [hf_reference[ARCH].greedy(p, 8) for p in prompts[:4]]
    k1 = SamplingParams(temperature=1.5, top_k=1, max_tokens=8, ignore_eos=True)
    p_small = SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=8, ignore_eos=True)
    assert [o.token_ids for o in run_all(engine, prompts[:4], k1)] == greedy
    assert [o.token_ids for o in run_all(engine, prompts[:4], p_small)] == greedy


@pytest.mark.parametrize("temperature", [1e-45, 1e-6])
def test_a_vanishing_temperature_is_greedy(engine, prompts, hf_reference, temperature):
    """Dividing the logits by 1e-45 overflows to inf and NaN probabilities; such a request samples greedily."""
    params = SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True)
    assert run_all(engine, [prompts[2]], params)[0].token_ids == hf_reference[ARCH].greedy(prompts[2], 8)


def test_top_k_limits_the_choice(engine, prompts, hf_reference):
    """With top_k=3 every sampled token is among the 3 most likely under the model."""
    model = hf_reference[ARCH].model
    params = SamplingParams(temperature=5.0, top_k=3, seed=3, max_tokens=10, ignore_eos=True)
    out = run_all(engine, [prompts[1]], params)[0].token_ids
    with torch.inference_mode():
        logits = model(torch.tensor([prompts[1] + out])).logits[0]
    for i, token in enumerate(out):
        top3 = logits[len(prompts[1]) - 1 + i].topk(3).indices.tolist()
        assert token in top3


def test_logprobs_match_the_model(engine, prompts, hf_reference):
    params = SamplingParams.greedy(max_tokens=5, ignore_eos=True, logprobs=True)
    out = run_all(engine, [prompts[2]], params)[0]
    with torch.inference_mode():
        logits = hf_reference[ARCH].model(torch.tensor([prompts[2] + out.token_ids])).logits[0]
    logp = torch.log_softmax(logits.float(), dim=-1)
    want = [logp[len(prompts[2]) - 1 + i, t].item() for i, t in enumerate(out.token_ids)]
    assert out.logprobs == pytest.approx(want, abs=1e-4)


def test_stop_conditions(engine, prompts, hf_reference):
    ref = hf_reference[ARCH].greedy(prompts[3], 12)
    # max_tokens
    out = run_all(engine, [prompts[3]], SamplingParams.greedy(max_tokens=4, ignore_eos=True))[0]
    assert out.token_ids == ref[:4] and out.finish_reason == "length"
    # a stop token id ends generation on (and including) that token
    stop_at = next(i for i, t in enumerate(ref) if i >= 2 and t not in ref[:i])
    out = run_all(engine, [prompts[3]], SamplingParams.greedy(max_tokens=12, stop_token_ids=[ref[stop_at]]))[0]
    assert out.token_ids == ref[: stop_at + 1] and out.finish_reason == "stop"
    # the model's EOS stops unless ignore_eos
    eos = next(iter(engine.eos_token_ids))
    out = run_all(engine, [prompts[3]], SamplingParams.greedy(max_tokens=12, stop_token_ids=[]))[0]
    assert (eos in out.token_ids) == (out.finish_reason == "stop")
    # a stop string: the text is cut before it, generation ends at the token completing it
    full_text = engine.tokenizer.decode(ref, skip_special_tokens=True)
    stop_text = full_text[len(full_text) // 2 : len(full_text) // 2 + 2]
    out = run_all(engine, [prompts[3]], SamplingParams.greedy(max_tokens=12, ignore_eos=True, stop=[stop_text]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full_text[: full_text.find(stop_text)]
    assert out.token_ids == ref[: len(out.token_ids)]
    assert stop_text in engine.tokenizer.decode(out.token_ids) and stop_text not in engine.tokenizer.decode(out.token_ids[:-1])
    assert_pool_idle(engine)


def test_generation_stops_at_the_context_limit(model_dirs, hf_reference):
    engine = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=16 * 2**20, max_model_len=40))
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 30, 30, seed=4)[0]
    out = run_all(engine, [prompt], SamplingParams.greedy(max_tokens=100, ignore_eos=True))[0]
    assert len(prompt) + len(out.token_ids) == 40 and out.finish_reason == "length"
    assert out.token_ids == hf_reference[ARCH].greedy(prompt, 10)

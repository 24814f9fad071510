"""Bad input raises a ValueError that names the parameter; the engine keeps serving."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import random_prompts
from helpers import assert_pool_idle

from pdserve.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

ARCH = "tiny-llama"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"top_p": float("nan")}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"seed": -5}, "seed must be an integer"),
        ({"stop": [""]}, "stop must be a list of non-empty strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be non-negative"),
        ({"stop_token_ids": [7] * 2_000_000}, "stop_token_ids holds 2000000 ids; at most 1024 are allowed"),
        ({"stop": ["x"] * 1_000_000}, "stop holds 1000000 strings; at most 64 are allowed"),
        ({"stop": ["ok", "x" * 10**6]}, "stop strings may have at most 1024 characters; the one at index 1 has "),
        ({"logprobs": 5}, "logprobs must be true or false, got 5"),
        ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
        ({"speculative": 0}, "speculative must be true or false"),
        ({"proposer": "x" * 10**6}, "proposer must be one of suffix, draft_model"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message) as e:
        SamplingParams(**kwargs)
    assert len(str(e.value)) < 200  # a client's huge value is never echoed


def test_sampling_params_at_their_bounds_are_taken():
    params = SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
                            stop_token_ids=range(MAX_STOP_TOKEN_IDS))
    assert len(params.stop) == MAX_STOP_STRINGS and len(params.stop_token_ids) == MAX_STOP_TOKEN_IDS


def test_bad_prompts_are_rejected_and_the_engine_keeps_serving(model_dirs, hf_reference):
    engine = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=16 * 2**20, max_model_len=128))
    vocab = hf_reference[ARCH].vocab_size
    good = random_prompts(3, vocab, 5, 50, seed=1)
    params = SamplingParams.greedy(max_tokens=6, ignore_eos=True)
    running = [engine.add_request(p, params) for p in good]
    engine.step()
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([], params)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("", params)
    with pytest.raises(ValueError, match=rf"token ids must be integers in \[0, {vocab}\)"):
        engine.add_request([5, vocab, 7], params)
    with pytest.raises(ValueError, match=r"token ids must be integers"):
        engine.add_request([5, -1], params)
    with pytest.raises(ValueError, match="context limit is 128"):
        engine.add_request([5] * 128, params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([5], params, request_id=running[0])
    with pytest.raises(ValueError, match="params must be a SamplingParams"):
        engine.add_request([5], {"temperature": 0})  # type: ignore[arg-type]
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert [outputs[r] for r in running] == [hf_reference[ARCH].greedy(p, 6) for p in good]
    assert_pool_idle(engine)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "float64"}, "dtype must be one of"),
        ({"dtype": "float16"}, "float16 is not supported on CPU"),
        ({"block_size": 0}, "block_size must be a positive integer"),
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer"),
        ({"prefill_chunk_size": 0}, "prefill_chunk_size must be >= 1"),
    ],
)
def test_bad_engine_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_pool_too_small_for_one_sequence(model_dirs):
    with pytest.raises(ValueError, match="fewer than one sequence of max_model_len"):
        LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=1024, max_model_len=1024))


def test_unknown_model(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        LLM("no-such-model")
    with pytest.raises(FileNotFoundError, match="model directory '/models/absent' does not exist"):
        LLM("/models/absent")  # a path is not taken for a misspelt preset name
    with pytest.raises(ValueError, match="has no config.json"):
        LLMEngine(tmp_path)


def test_llm_generate_rejects_a_bad_prompt_without_side_effects(model_dirs, hf_reference):
    llm = LLM(str(model_dirs[ARCH]), kv_memory_bytes=16 * 2**20)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[5, 6], []], SamplingParams.greedy(max_tokens=2))
    assert_pool_idle(llm.engine)
    out = llm.generate(["hello world", [5, 6, 7]], SamplingParams.greedy(max_tokens=3, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [3, 3] and isinstance(out[0].text, str)
    assert out[1].token_ids == hf_reference[ARCH].greedy([5, 6, 7], 3)


def test_a_handoff_whose_logprobs_do_not_match_its_tokens_is_refused(model_dirs, hf_reference):
    """Neither an import's commit nor a resume takes a handoff with a logprob count other than none or
    one per sampled token (zipping them would append a missing token); the import can still commit."""
    prefill = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=16 * 2**20))
    decode = LLMEngine(model_dirs[ARCH], EngineConfig(kv_memory_bytes=16 * 2**20))
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 20, 20, seed=3)[0]
    params = SamplingParams.greedy(max_tokens=4, ignore_eos=True)
    request_id = prefill.add_request(prompt, params, prefill_only=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    handoff = prefill.export_handoff(request_id)
    decode.begin_import(request_id, handoff.prompt_token_ids, handoff.params, handoff.num_computed_tokens)
    decode.import_kv(prefill.export_kv(request_id))
    bad = dataclasses.replace(handoff, logprobs=[-0.5, -0.5])
    for refused in (decode.commit_import, decode.resume_request):
        with pytest.raises(ValueError, match="2 logprobs for 1 sampled tokens"):
            refused(bad)
    decode.commit_import(handoff)
    prefill.release(request_id)
    while decode.has_unfinished_requests():
        finished = [out for out in decode.step() if out.finished]
    assert finished[0].token_ids == hf_reference[ARCH].greedy(prompt, 4)
    assert_pool_idle(decode)

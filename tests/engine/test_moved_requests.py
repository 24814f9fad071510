"""Moving a decoding request between engines with its KV (live migration), engine side."""

from __future__ import annotations

import pytest
from helpers import assert_pool_idle, drain, random_prompts, run_all

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams

ARCH = "tiny-llama"


def make_engine(model_dirs, **kwargs) -> LLMEngine:
    kwargs.setdefault("kv_memory_bytes", 16 * 2**20)
    return LLMEngine(model_dirs[ARCH], EngineConfig(**kwargs))


def move(source: LLMEngine, target: LLMEngine, request_id: str) -> None:
    """Take a decoding request out of `source` and continue it on `target`, its KV and all."""
    handoff = source.hold_decoding(request_id)
    assert handoff is not None
    target.begin_import(request_id, handoff.prompt_token_ids, handoff.params, handoff.num_computed_tokens,
                        output_token_ids=handoff.output_token_ids[:-1])
    target.import_kv(source.export_kv(request_id))
    target.commit_import(handoff)
    source.release(request_id)


def params_for(kind: str, i: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams.greedy(max_tokens=24, ignore_eos=True)
    return SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_a_moved_request_continues_exactly(model_dirs, hf_reference, kind):
    """Requests moved after different numbers of steps (one still prefilling stays) produce the tokens
    an undisturbed run produces, and both engines end with no block held."""
    prompts = random_prompts(4, hf_reference[ARCH].vocab_size, 20, 150, seed=21)
    params = [params_for(kind, i) for i in range(len(prompts))]
    undisturbed = [o.token_ids for o in run_all(make_engine(model_dirs), prompts, params)]

    source, target = make_engine(model_dirs), make_engine(model_dirs)
    ids = [source.add_request(p, sp) for p, sp in zip(prompts, params)]
    finished = {}
    for step in range(12):
        finished.update({o.request_id: o.token_ids for o in source.step() if o.finished})
        if step in (2, 7):  # move two requests at different points of their decode
            move(source, target, ids[step % 4])
    assert finished == {}
    moved = [ids[2], ids[3]]
    for engine, held in ((source, [i for i in ids if i not in moved]), (target, moved)):
        finished.update({o.request_id: o.token_ids for o in drain(engine, held)})
    assert [finished[i] for i in ids] == undisturbed
    assert_pool_idle(source)
    assert_pool_idle(target)


def test_a_held_request_resumes_in_place_and_only_decoding_ones_are_held(model_dirs, hf_reference):
    prompts = random_prompts(2, hf_reference[ARCH].vocab_size, 100, 120, seed=5)
    greedy = SamplingParams.greedy(max_tokens=16, ignore_eos=True)
    engine = make_engine(model_dirs, max_num_batched_tokens=64)  # the prompts take several chunked steps
    decoding, prefilling = engine.add_request(prompts[0], greedy), None
    for _ in range(4):
        engine.step()
    prefilling = engine.add_request(prompts[1], greedy)
    engine.step()
    assert engine.hold_decoding(prefilling) is None  # mid-prompt: nothing to move but tokens
    assert engine.hold_decoding("no-such-request") is None
    handoff = engine.hold_decoding(decoding)
    assert handoff is not None and handoff.num_computed_tokens == len(prompts[0]) + len(handoff.output_token_ids) - 1
    assert engine.hold_decoding(decoding) is None  # held already
    engine.step()  # the held request takes no step
    assert engine.requests[decoding].output_token_ids == handoff.output_token_ids
    engine.resume_held(decoding)  # its move failed: it goes on here
    outputs = drain(engine, [decoding, prefilling])
    assert [o.token_ids for o in outputs] == [hf_reference[ARCH].greedy(p, 16) for p in prompts]
    assert_pool_idle(engine)


def test_an_import_that_does_not_continue_its_reserved_tokens_is_refused(model_dirs, hf_reference):
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 30, 30, seed=8)[0]
    source, target = make_engine(model_dirs), make_engine(model_dirs)
    request_id = source.add_request(prompt, SamplingParams.greedy(max_tokens=16, ignore_eos=True))
    for _ in range(4):
        source.step()
    handoff = source.hold_decoding(request_id)
    wrong = [t + 1 for t in handoff.output_token_ids[:-1]]
    target.begin_import(request_id, handoff.prompt_token_ids, handoff.params, handoff.num_computed_tokens,
                        output_token_ids=wrong)
    with pytest.raises(ValueError, match="does not continue"):
        target.commit_import(handoff)
    assert target.abort_request(request_id) and source.abort_request(request_id)
    assert_pool_idle(source)
    assert_pool_idle(target)


def test_a_moved_request_whose_kv_is_inexact_is_never_cached_as_a_prefix_on_its_new_engine(model_dirs, hf_reference):
    """KV that came through a lossy codec stays inexact wherever the request moves: its blocks never
    enter the new engine's prefix cache, where another request would take them for exact KV."""
    prompt = random_prompts(1, hf_reference[ARCH].vocab_size, 64, 64, seed=9)[0]
    source, target = make_engine(model_dirs), make_engine(model_dirs)
    request_id = source.add_request(prompt, SamplingParams.greedy(max_tokens=8, ignore_eos=True))
    for _ in range(3):
        source.step()
    source.requests[request_id].exact_kv = False  # as a lossy codec's import leaves it
    move(source, target, request_id)
    assert target.requests[request_id].exact_kv is False
    drain(target, [request_id])
    assert target.pool.num_free == target.pool.num_blocks and not target.pool.cached_blocks()

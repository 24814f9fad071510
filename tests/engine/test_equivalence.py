"""Token-exact equality with transformers' `generate` (greedy) on every engine path."""

from __future__ import annotations

import pytest
from helpers import TEST_PRESETS, random_prompts
from helpers import assert_pool_idle, run_all

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams

NEW_TOKENS = 12
GREEDY = SamplingParams.greedy(max_tokens=NEW_TOKENS, ignore_eos=True)


def expected(hf_reference, arch, prompts, n=NEW_TOKENS):
    return [hf_reference[arch].greedy(p, n) for p in prompts]


def make_engine(model_dirs, arch, **kwargs) -> LLMEngine:
    kwargs.setdefault("kv_memory_bytes", 16 * 2**20)
    return LLMEngine(model_dirs[arch], EngineConfig(**kwargs))


@pytest.mark.parametrize("arch", TEST_PRESETS)
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_batched_greedy_matches_generate(model_dirs, hf_reference, arch, batch):
    prompts = random_prompts(batch, hf_reference[arch].vocab_size, 1, 320, seed=batch)
    if batch > 1:
        prompts[0] = prompts[0][:1]  # a one-token prompt in a batch
        prompts[1] = (prompts[1] * 20)[:330]  # one over 300 tokens, across many block boundaries
    engine = make_engine(model_dirs, arch, max_num_batched_tokens=4096)
    outputs = run_all(engine, prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected(hf_reference, arch, prompts)
    assert_pool_idle(engine)


@pytest.mark.parametrize("arch", TEST_PRESETS)
def test_prefix_cache_hits_keep_outputs_exact(model_dirs, hf_reference, arch):
    vocab = hf_reference[arch].vocab_size
    shared = random_prompts(1, vocab, 70, 70, seed=7)[0]  # 4 full blocks + 6 tokens
    tails = random_prompts(6, vocab, 1, 40, seed=8)
    prompts = [shared + t for t in tails] + [shared[:32], shared[:33], shared]
    engine = make_engine(model_dirs, arch)
    first = run_all(engine, prompts[:1], GREEDY)  # warms the cache with the shared prefix
    rest = run_all(engine, prompts[1:], GREEDY)
    assert [o.token_ids for o in first + rest] == expected(hf_reference, arch, prompts)
    assert engine.pool.stats.hit_blocks > 0
    assert all(o.num_cached_tokens > 0 for o in rest[:5])
    # A prompt that is exactly cached blocks still recomputes its last block (never writes a shared block).
    assert rest[-3].num_cached_tokens == 16 and rest[-2].num_cached_tokens == 32
    assert_pool_idle(engine)
    assert engine.pool.num_cached > 0  # cached blocks survive as free-and-evictable


@pytest.mark.parametrize("arch", TEST_PRESETS)
@pytest.mark.parametrize("chunk", [7, 64])
def test_chunked_prefill_matches_generate(model_dirs, hf_reference, arch, chunk):
    prompts = random_prompts(10, hf_reference[arch].vocab_size, 1, 310, seed=chunk)
    engine = make_engine(model_dirs, arch, prefill_chunk_size=chunk, max_num_batched_tokens=96)
    outputs = run_all(engine, prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected(hf_reference, arch, prompts)
    assert_pool_idle(engine)


def test_the_preempt_hook_hears_of_each_preempted_request_before_its_blocks_are_written_again(model_dirs, hf_reference):
    """A sender reading a request's KV behind the layer hook must stop before the step that preempted
    the request writes into its old blocks: the preempt hook names every preempted request, and is
    called before that step's first layer is written."""
    arch = "tiny-qwen2"
    probe = make_engine(model_dirs, arch, max_model_len=512)
    engine = make_engine(model_dirs, arch, max_model_len=512,
                         kv_memory_bytes=(512 // 16 + 4) * probe.kv_layout.bytes_per_block)
    events: list[tuple[str, object]] = []
    engine.set_preempt_hook(lambda request_id: events.append(("preempted", request_id)))
    engine.set_layer_hook(lambda layer, chunks: events.append(("layer", layer)))
    prompts = random_prompts(8, hf_reference[arch].vocab_size, 100, 300, seed=4)
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams.greedy(max_tokens=40, ignore_eos=True))
    for _ in range(20_000):
        if not engine.has_unfinished_requests():
            break
        events.append(("step", None))
        engine.step()
    preempted = [e for e in events if e[0] == "preempted"]
    assert engine.scheduler.num_preemptions > 0 and len(preempted) == engine.scheduler.num_preemptions
    for i, (kind, _) in enumerate(events):
        if kind == "preempted":  # nothing of this step's forward pass came before it
            step_start = max(j for j in range(i) if events[j][0] == "step")
            assert all(kind == "preempted" for kind, _ in events[step_start + 1 : i])
    assert_pool_idle(engine)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_under_a_tiny_pool(model_dirs, hf_reference, prefix_caching):
    arch = "tiny-qwen2"
    engine = make_engine(model_dirs, arch, max_model_len=512, enable_prefix_caching=prefix_caching)
    blocks_for_512 = 512 // 16
    # Shrink the pool to just above one full-length sequence, so concurrent requests must preempt.
    engine_small = make_engine(
        model_dirs, arch, max_model_len=512, enable_prefix_caching=prefix_caching,
        kv_memory_bytes=(blocks_for_512 + 4) * engine.kv_layout.bytes_per_block,
    )
    prompts = random_prompts(16, hf_reference[arch].vocab_size, 40, 300, seed=3)
    params = SamplingParams.greedy(max_tokens=40, ignore_eos=True)
    outputs = run_all(engine_small, prompts, params)
    assert engine_small.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == expected(hf_reference, arch, prompts, 40)
    assert_pool_idle(engine_small)


def hand_over(prefill: LLMEngine, decode: LLMEngine, prompts: list[list[int]], layer_by_layer: bool = False) -> list[str]:
    """Prefill `prompts` on `prefill`, move each one's KV into `decode` and commit it there."""
    ids = [prefill.add_request(p, GREEDY, prefill_only=True) for p in prompts]
    while prefill.has_unfinished_requests():
        prefill.step()
    num_layers = prefill.kv_layout.num_layers
    for request_id in ids:
        handoff = prefill.export_handoff(request_id)
        assert len(handoff.output_token_ids) == 1
        decode.begin_import(request_id, handoff.prompt_token_ids, handoff.params, handoff.num_computed_tokens)
        if layer_by_layer:
            for layer in range(num_layers):
                decode.import_kv(prefill.export_kv(request_id, layer=layer))
        else:
            kv = prefill.export_kv(request_id)
            assert kv.data.shape[0] == num_layers
            decode.import_kv(kv)
        decode.commit_import(handoff)
        prefill.release(request_id)
    assert_pool_idle(prefill)
    return ids


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-mistral", "tiny-gemma2"])
@pytest.mark.parametrize("layer_by_layer", [False, True])
def test_export_import_continues_exactly(model_dirs, hf_reference, arch, layer_by_layer):
    prompts = random_prompts(6, hf_reference[arch].vocab_size, 1, 200, seed=11)
    prefill = make_engine(model_dirs, arch)
    decode = make_engine(model_dirs, arch, max_num_seqs=4)  # 6 imports: 2 wait for a slot in the batch
    ids = hand_over(prefill, decode, prompts, layer_by_layer)
    done = {}
    while decode.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in decode.step() if o.finished})
        assert len(decode.scheduler.running) <= 4
    assert [done[i] for i in ids] == expected(hf_reference, arch, prompts)
    assert_pool_idle(decode)


def test_imports_that_fill_the_pool_still_complete_exactly(model_dirs, hf_reference):
    """Three committed imports of two full blocks each hold all six blocks of the pool, and each needs
    a seventh for its first step: those queued behind give their blocks back and are recomputed, so
    all complete, token-exact. An import aborted while it waits for its slot frees its blocks."""
    arch = "tiny-llama"
    prefill = make_engine(model_dirs, arch)
    decode = make_engine(model_dirs, arch, max_model_len=96, kv_memory_bytes=6 * prefill.kv_layout.bytes_per_block)
    prompts = random_prompts(3, hf_reference[arch].vocab_size, 32, 32, seed=13)
    ids = hand_over(prefill, decode, prompts)
    assert decode.pool.num_free == 0
    done = {}
    for _ in range(200):  # bounded: a stuck engine fails here instead of hanging
        if not decode.has_unfinished_requests():
            break
        done.update({o.request_id: o.token_ids for o in decode.step() if o.finished})
    assert [done.get(i) for i in ids] == expected(hf_reference, arch, prompts)
    assert decode.scheduler.num_preemptions >= 1
    assert_pool_idle(decode)
    [waiting] = hand_over(prefill, decode, prompts[:1])
    assert decode.abort_request(waiting)
    assert_pool_idle(decode)


def test_abort_frees_blocks_in_every_state(model_dirs, hf_reference):
    arch = "tiny-llama"
    engine = make_engine(model_dirs, arch, max_num_batched_tokens=64)
    prompts = random_prompts(4, hf_reference[arch].vocab_size, 100, 150, seed=5)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()  # first prompt partially prefilled, others waiting
    assert engine.num_free_blocks < engine.pool.num_blocks
    for request_id in ids:
        assert engine.abort_request(request_id)
    assert not engine.abort_request("no-such-request")
    assert_pool_idle(engine)
    # The engine keeps serving after the aborts.
    assert run_all(engine, prompts[:1], GREEDY)[0].token_ids == expected(hf_reference, arch, prompts[:1])[0]


def test_layer_hook_sees_each_layer_as_it_is_written(model_dirs, hf_reference):
    """Layer-wise export during the forward pass gives the same KV as exporting after it."""
    arch = "tiny-llama"
    prompt = random_prompts(1, hf_reference[arch].vocab_size, 50, 50, seed=13)[0]
    engine = make_engine(model_dirs, arch)
    seen: list[tuple[int, object]] = []

    def hook(layer, chunks):
        (chunk,) = chunks
        seen.append((layer, engine.kv_cache.read(chunk.seq.block_table, layer)))

    engine.set_layer_hook(hook)
    request_id = engine.add_request(prompt, GREEDY, prefill_only=True)
    engine.step()
    assert [layer for layer, _ in seen] == list(range(engine.kv_layout.num_layers))
    for layer, data in seen:
        assert data.equal(engine.export_kv(request_id, layer=layer).data)
    engine.release(request_id)
    assert_pool_idle(engine)

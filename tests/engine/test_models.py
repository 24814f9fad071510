"""Presets build deterministic Hugging Face checkpoints; supported architectures and dtypes load."""

from __future__ import annotations

import hashlib

import pytest
import torch
from helpers import random_prompts
from helpers import assert_pool_idle, run_all
from transformers import AutoConfig, AutoModelForCausalLM

from pdserve.engine import PRESETS, EngineConfig, LLMEngine, SamplingParams, make_model, resolve_model
from pdserve.engine.model_loader import eos_ids, load_tokenizer
from pdserve.engine.models.presets import preset_info


def digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_make_model_is_deterministic_by_seed(tmp_path, model_dirs):
    again = make_model("tiny-llama", tmp_path / "a", seed=0)
    other = make_model("tiny-llama", tmp_path / "b", seed=1)
    assert digest(again) == digest(model_dirs["tiny-llama"])
    assert digest(other) != digest(again)
    assert (again / "tokenizer.json").read_bytes() == (model_dirs["tiny-llama"] / "tokenizer.json").read_bytes()


def test_checkpoint_is_a_plain_hf_directory(model_dirs):
    tokenizer = load_tokenizer(model_dirs["tiny-qwen2"])
    model = AutoModelForCausalLM.from_pretrained(model_dirs["tiny-qwen2"])
    assert model.config.tie_word_embeddings and model.config.vocab_size == len(tokenizer)
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's QKV biases
    text = "The water was first, then people."
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize(("preset", "low", "high"), [("llama-20m", 15e6, 25e6), ("qwen2-20m", 12e6, 25e6),
                                                     ("llama-150m", 130e6, 170e6)])
def test_preset_sizes(preset, low, high):
    config = PRESETS[preset].hf_config(vocab_size=PRESETS[preset].vocab_size)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert low <= sum(p.numel() for p in model.parameters()) <= high


def test_resolve_model_builds_once_and_caches(tmp_path):
    first = resolve_model("tiny-mistral", cache_dir=tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    second = resolve_model("tiny-mistral", cache_dir=tmp_path)
    assert first == second and (second / "model.safetensors").stat().st_mtime_ns == stamp
    assert preset_info(first)["preset"] == "tiny-mistral"


def test_bfloat16_on_cpu(model_dirs, hf_reference):
    """bf16 runs end to end; its greedy tokens agree with HF's own bf16 run on most of each sequence."""
    arch = "tiny-llama"
    engine = LLMEngine(model_dirs[arch], EngineConfig(dtype="bfloat16", kv_memory_bytes=16 * 2**20))
    assert engine.kv_cache.data.dtype == torch.bfloat16
    ref = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.bfloat16)
    prompts = random_prompts(4, hf_reference[arch].vocab_size, 5, 60, seed=2)
    outs = run_all(engine, prompts, SamplingParams.greedy(max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                            eos_token_id=None)[0, len(prompt):].tolist()
        assert out.token_ids[0] == want[0]  # first token from the same bf16 logits
    assert_pool_idle(engine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_runs_and_matches_first_tokens(model_dirs, hf_reference, dtype):
    arch = "tiny-llama"
    engine = LLMEngine(model_dirs[arch], EngineConfig(device="cuda", dtype=dtype, kv_memory_bytes=64 * 2**20))
    ref = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=getattr(torch, dtype)).cuda()
    prompts = random_prompts(8, hf_reference[arch].vocab_size, 5, 200, seed=9)
    outs = run_all(engine, prompts, SamplingParams.greedy(max_tokens=4, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        want = ref.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=4, do_sample=False,
                            pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
        assert out.token_ids[0] == want[0]
    assert_pool_idle(engine)


def test_every_eos_id_of_the_config_and_the_tokenizer_ends_generation(model_dirs):
    """A config may list several EOS ids (Llama 3 does); each one, and the tokenizer's, stops a request."""
    config = AutoConfig.from_pretrained(model_dirs["tiny-llama"])
    tokenizer = load_tokenizer(model_dirs["tiny-llama"])
    config.eos_token_id = [7, 11]
    assert eos_ids(config, tokenizer) == {7, 11, tokenizer.eos_token_id}
    config.eos_token_id = None
    assert eos_ids(config, tokenizer) == {tokenizer.eos_token_id}

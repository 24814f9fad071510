"""Support is decided by what a model does: what the engine cannot serve exactly is refused at load
with an error naming the missing property (the families it serves: test_equivalence.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from helpers import HFReference, random_prompts
from helpers import run_all

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.models.tokenizer import build_tokenizer

SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
         "intermediate_size": 64}


class BypassConfig(LlamaConfig):
    model_type = "pdserve-test-bypass"


class BypassForCausalLM(LlamaForCausalLM):
    """A Llama whose second layer mixes tokens without transformers' attention interface."""

    config_class = BypassConfig

    def __init__(self, config: BypassConfig) -> None:
        super().__init__(config)
        attention = self.model.layers[1].self_attn
        attention.forward = lambda hidden_states, *args, **kwargs: (
            attention.o_proj(torch.cumsum(hidden_states, dim=1)), None)


AutoConfig.register(BypassConfig.model_type, BypassConfig)
AutoModelForCausalLM.register(BypassConfig, BypassForCausalLM)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(256, 0)


def checkpoint(root: Path, tokenizer, model_type: str, weights: bool, **config) -> Path:
    """A directory with config.json and a tokenizer; with random weights when the check needs them."""
    directory = root / model_type
    hf_config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **config)
    if weights:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(hf_config).save_pretrained(directory)
    else:
        hf_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize(("model_type", "weights", "config", "message"), [
    ("t5", False, {"d_model": 32, "num_layers": 1, "num_heads": 2, "d_ff": 64, "d_kv": 16},
     r"encoder-decoder model \(config.is_encoder_decoder\)"),
    ("idefics3", False, {}, r"is multimodal \(vision_config\) of a family the engine does not place images for"),
    ("deepseek_v3", False, {**SMALL, "kv_lora_rank": 16, "q_lora_rank": 16},
     r"multi-head latent attention \(kv_lora_rank\)"),
    ("qwen3_next", False, SMALL, "has layers of type linear_attention"),
    ("gpt_oss", True, {**SMALL, "head_dim": 16, "num_local_experts": 2, "num_experts_per_tok": 1},
     r"attention sinks \(s_aux\)"),
    ("doge", True, SMALL,  # a learnt bias added to the scores through attention_mask
     r"an attention mask or bias of its own \(attention_mask\)"),
    ("falcon", True, {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2},
     "does not take attention functions through transformers' attention interface"),
    ("mpt", True, {"d_model": 32, "n_heads": 2, "n_layers": 2, "expansion_ratio": 2},  # ALiBi in its own attention
     "its forward pass fails under the engine's attention"),
    (BypassConfig.model_type, True, SMALL,
     r"layers \[1\] of 2 do not run their attention once each through transformers' attention interface"),
])
def test_a_model_the_engine_cannot_serve_exactly_is_refused_by_property(
        tmp_path, tokenizer, model_type, weights, config, message):
    directory = checkpoint(tmp_path, tokenizer, model_type, weights, **config)
    with pytest.raises(ValueError, match=message):
        LLMEngine(directory, EngineConfig(kv_memory_bytes=4 * 2**20))


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8, "rope_theta": 1e4}


@pytest.mark.parametrize(("model_type", "config", "served"), [
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, 128),
    # Phi-3's 128K models: the long factors past original_max_position_embeddings (its config's own field)
    ("phi3", {"rope_parameters": LONGROPE, "original_max_position_embeddings": 48}, 48),
])
def test_rope_that_follows_the_batch_past_a_length_is_served_exactly_up_to_it(tmp_path, tokenizer, model_type, config,
                                                                              served):
    """Frequencies that depend on the longest sequence of a batch are fixed below a length: a batch of
    prompts of different lengths, up to the context limit, gives each one what `generate` gives it alone."""
    directory = checkpoint(tmp_path, tokenizer, model_type, True, **SMALL, **config, max_position_embeddings=128,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2)
    reference = HFReference(directory)
    engine = LLMEngine(directory, EngineConfig(kv_memory_bytes=4 * 2**20))
    assert engine.max_model_len == served
    prompts = random_prompts(3, len(tokenizer), 5, served - 12, seed=5) + [[7] * (served - 8)]
    outputs = run_all(engine, prompts, SamplingParams.greedy(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outputs] == [reference.greedy(p, 8) for p in prompts]


def test_dynamic_rope_is_refused_past_its_rotary_s_cached_length(tmp_path, tokenizer, monkeypatch):
    directory = checkpoint(tmp_path, tokenizer, "llama", True, **SMALL, max_position_embeddings=128,
                           rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    from transformers.models.llama import modeling_llama

    init = modeling_llama.LlamaRotaryEmbedding.__init__

    def shorter_cache(self, config, *args, **kwargs):  # as a rotary that starts its cache below the context
        init(self, config, *args, **kwargs)
        self.max_seq_len_cached = 64

    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "__init__", shorter_cache)
    with pytest.raises(ValueError, match=r"follow the longest sequence of a batch past 64 tokens: serve it with "
                                         r"max_model_len <= 64"):
        LLMEngine(directory, EngineConfig(kv_memory_bytes=4 * 2**20))
    assert LLMEngine(directory, EngineConfig(kv_memory_bytes=4 * 2**20, max_model_len=64)).max_model_len == 64

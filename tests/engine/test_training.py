"""The trained model: the recipe runs (a tiny version of it here) and is deterministic, its held-out
split is disjoint from its training split, and the shipped checkpoint is a real language model of
Python source (far better than chance on text it never saw), served exactly like transformers."""

from __future__ import annotations

import json
import math

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.models.presets import resolve_model
from pdserve.engine.models.training import RECIPE_FILE, TrainConfig, corpus_files, heldout_loss, heldout_text, train

TINY = TrainConfig(steps=3, vocab_size=512, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                   intermediate_size=64, seq_len=32, batch_size=2, warmup_steps=1, eval_tokens=128,
                   max_train_chars=100_000, threads=1)


def test_the_recipe_runs_and_is_deterministic(tmp_path):
    first = train(TINY, tmp_path / "a", progress=False)
    train(TINY, tmp_path / "b", progress=False)
    weights = [(tmp_path / d / "model.safetensors").read_bytes() for d in ("a", "b")]
    assert weights[0] == weights[1]
    recipe = json.loads((tmp_path / "a" / RECIPE_FILE).read_text())
    assert recipe["recipe"]["steps"] == 3 and recipe["results"]["heldout_loss"] == first["heldout_loss"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert model.config.num_hidden_layers == 1


def test_held_out_files_are_never_trained_on():
    train_files, heldout = set(corpus_files("train")), set(corpus_files("heldout"))
    assert heldout and train_files and not train_files & heldout
    assert 0.01 < len(heldout) / (len(heldout) + len(train_files)) < 0.06


def test_the_shipped_model_knows_python_and_is_served_exactly():
    model_dir = resolve_model("pystd-llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(tokenizer(heldout_text(40_000), add_special_tokens=False)["input_ids"][:4096])
    loss, _ = heldout_loss(model, ids, 1024, 4096)
    assert math.exp(loss) < 200 < len(tokenizer)  # chance would be a perplexity of the vocabulary size

    prompt = tokenizer("import os\n\n\ndef main():\n", add_special_tokens=False)["input_ids"]
    reference = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    out = LLM(str(model_dir)).generate([prompt], SamplingParams.greedy(max_tokens=24))[0]
    assert out.token_ids == reference

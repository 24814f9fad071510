"""The models pdserve makes carry a plain-text chat template (for /v1/chat/completions): the shipped
trained model and the presets, including a preset cached before the template existed."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.model_loader import load_tokenizer
from pdserve.engine.models.presets import BUILD_VERSION, MARKER, resolve_model
from pdserve.engine.models.tokenizer import CHAT_TEMPLATE

CONVERSATION = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Sort a list."},
]
AS_PARTS = [
    {"role": "system", "content": [{"type": "text", "text": "You write Python."}]},
    {"role": "user", "content": [{"type": "text", "text": "Sort "}, {"type": "text", "text": "a list."}]},
]
EXPECTED = "system: You write Python.\nuser: Sort a list.\nassistant:"


def render(tokenizer, messages, add_generation_prompt=True):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)


@pytest.fixture(scope="module")
def preset_dir(tmp_path_factory):
    return resolve_model("tiny-llama", cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("which", ["shipped", "preset"])
def test_models_render_chat_messages(which, preset_dir):
    model_dir = resolve_model("pystd-llama") if which == "shipped" else preset_dir
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert render(tokenizer, CONVERSATION) == EXPECTED
    assert render(tokenizer, AS_PARTS) == EXPECTED
    assert render(tokenizer, CONVERSATION, add_generation_prompt=False) == EXPECTED.removesuffix("assistant:")


def test_a_preset_cached_without_the_template_is_rebuilt(tmp_path):
    model_dir = resolve_model("tiny-llama", cache_dir=tmp_path)
    (model_dir / "chat_template.jinja").unlink()
    marker = model_dir / MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "build_version": BUILD_VERSION - 1}))
    assert load_tokenizer(model_dir).chat_template is None
    assert resolve_model("tiny-llama", cache_dir=tmp_path) == model_dir
    assert render(load_tokenizer(model_dir), CONVERSATION) == EXPECTED

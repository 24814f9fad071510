"""A Hugging Face Hub id as the model, resolved from the Hub's cache under HF_HOME with HF_HUB_OFFLINE=1
(no network): a small model is placed in a temporary cache in the layout huggingface_hub documents
(`hub/models--ORG--NAME/snapshots/REVISION/` and `refs/main`), and a fresh process, as a user starts
one, resolves the id to it and loads it. An id missing from the cache is refused, saying where it
looked and how to get it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import hub_cache

from pdserve.cluster.manifest import load_manifest
from pdserve.engine.models.hub import is_hub_id
from pdserve.engine.models.presets import make_model

REPO_ID = "pdserve-tests/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"  # a commit hash, as refs/main holds one
RESOLVE = """
import json, sys
from transformers import AutoConfig
from pdserve.engine.model_loader import load_tokenizer
from pdserve.engine.models.presets import resolve_model
try:
    path = resolve_model(sys.argv[1])
except FileNotFoundError as e:
    print(json.dumps({"error": str(e)}))
else:
    print(json.dumps({"path": str(path), "model_type": AutoConfig.from_pretrained(path).model_type,
                      "vocab": len(load_tokenizer(path))}))
"""


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    """An HF_HOME whose Hub cache holds REPO_ID at REVISION (and refs/main pointing at it)."""
    home = tmp_path_factory.mktemp("hf-home")
    hub_cache(home, REPO_ID, make_model("tiny-llama", tmp_path_factory.mktemp("built") / "tiny-llama", seed=0),
              REVISION)
    return home


def resolve_offline(model: str, hf_home: Path) -> dict:
    """`resolve_model(model)` in a fresh process with HF_HOME set and the Hub out of reach."""
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    done = subprocess.run([sys.executable, "-c", RESOLVE, model], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_hub_id_resolves_to_its_snapshot_in_the_local_cache(hf_home):
    found = resolve_offline(REPO_ID, hf_home)
    assert Path(found["path"]) == hf_home / "hub" / "models--pdserve-tests--tiny-llama" / "snapshots" / REVISION
    assert found["model_type"] == "llama" and found["vocab"] > 0


def test_a_hub_id_missing_from_the_cache_is_refused_offline_saying_how_to_get_it(hf_home):
    found = resolve_offline("pdserve-tests/not-cached", hf_home)
    assert "model 'pdserve-tests/not-cached' is not in the Hugging Face cache" in found["error"]
    assert str(hf_home / "hub") in found["error"] and "HF_HUB_OFFLINE is set" in found["error"]
    assert "hf download pdserve-tests/not-cached" in found["error"]


def test_a_manifest_names_a_hub_model_by_its_id():
    m = load_manifest({"model": REPO_ID})
    assert m.model == REPO_ID and m.served_name == REPO_ID


@pytest.mark.parametrize(("name", "hub"), [
    ("Qwen/Qwen2.5-0.5B-Instruct", True), ("org/name", True), ("tiny-llama", False), ("./org/name", False),
    ("/models/org", False), ("~/models", False), ("a/b/c", False), ("org/na me", False),
])
def test_what_is_read_as_a_hub_id(name, hub):
    assert is_hub_id(name) is hub

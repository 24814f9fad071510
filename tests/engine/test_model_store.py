"""A model reaches every node with the launcher's bytes: digests, shipping a directory to a node that
lacks it, and refusing a copy that differs."""

from __future__ import annotations

import shutil

import pytest

from pdserve.engine.model_store import ModelSource, materialize, model_digest, read_model_files


@pytest.fixture
def model_dir(model_dirs, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(model_dirs["tiny-llama"], copy)
    return copy


def test_the_digest_covers_the_model_files_and_nothing_else(model_dir):
    digest = model_digest(model_dir)
    (model_dir / "pdserve_preset.json").write_text("{}")  # build bookkeeping is not the model
    (model_dir / ".lock").write_text("")
    assert model_digest(model_dir) == digest
    (model_dir / "config.json").write_text((model_dir / "config.json").read_text() + " ")
    assert model_digest(model_dir) != digest


def test_a_node_without_the_directory_gets_the_shipped_files(model_dir, tmp_path):
    files = read_model_files(model_dir)
    source = ModelSource(str(tmp_path / "not-on-this-node"), model_digest(model_dir), files="ref")
    fetched = []
    got = materialize(source, lambda ref: fetched.append(ref) or files, cache_dir=tmp_path / "cache" / "models")
    assert fetched == ["ref"] and model_digest(got) == source.digest
    assert materialize(source, lambda ref: pytest.fail("fetched twice"), cache_dir=tmp_path / "cache" / "models") == got


def test_a_copy_that_differs_is_refused(model_dir, tmp_path):
    source = ModelSource(str(model_dir), model_digest(model_dir))
    assert materialize(source, lambda ref: {}) == model_dir
    (model_dir / "config.json").write_text((model_dir / "config.json").read_text() + " ")
    with pytest.raises(RuntimeError, match="differs on this node"):
        materialize(source, lambda ref: {})
    with pytest.raises(RuntimeError, match="declared shared"):
        materialize(ModelSource(str(tmp_path / "missing"), source.digest, shared_path=True), lambda ref: {})


def test_shipped_files_cannot_escape_the_model_directory(model_dir, tmp_path):
    source = ModelSource(str(tmp_path / "elsewhere"), "0" * 64, files="ref")
    with pytest.raises(ValueError, match="outside the model directory"):
        materialize(source, lambda ref: {"../evil.py": b""}, cache_dir=tmp_path / "cache" / "models")
    assert not (tmp_path / "cache" / "evil.py").exists()

"""A model reaches every node with the launcher's bytes: digests, shipping a directory to a node that
lacks it, and refusing a copy that differs."""

from __future__ import annotations

import shutil

import pytest

from pdserve.engine.model_store import ModelSource, files_digest, materialize, model_digest, read_model_files


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


def test_a_node_without_the_directory_gets_the_shipped_files(model_dir, tmp_path, monkeypatch):
    # The default cache, under a hidden directory as ~/.cache is: hidden parents do not hide the model.
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / ".cache" / "pdserve"))
    files = read_model_files(model_dir)
    assert sorted(files) == sorted(str(p.relative_to(model_dir)) for p in model_dir.iterdir() if p.is_file()
                                   and p.name != "pdserve_preset.json")
    source = ModelSource(str(tmp_path / "not-on-this-node"), model_digest(model_dir), files="ref")
    fetched = []
    got, digest = materialize(source, lambda ref: fetched.append(ref) or files)
    assert fetched == ["ref"] and digest == model_digest(got) == source.digest
    assert got.parent == tmp_path / ".cache" / "pdserve" / "shipped"
    assert materialize(source, lambda ref: pytest.fail("fetched twice"))[0] == got
    # A node whose copy at the path differs takes the shipped files instead.
    stale = ModelSource(str(model_dir), source.digest, files="ref")
    (model_dir / "config.json").write_text((model_dir / "config.json").read_text() + " ")
    assert materialize(stale, lambda ref: pytest.fail("already shipped here"))[0] == got


def test_on_one_machine_nothing_is_hashed(model_dir):
    assert materialize(ModelSource(str(model_dir), ""), lambda ref: pytest.fail("no shipping")) == (model_dir, "")


def test_a_copy_that_differs_is_refused(model_dir, tmp_path):
    source = ModelSource(str(model_dir), model_digest(model_dir))
    assert materialize(source, lambda ref: {}) == (model_dir, source.digest)
    (model_dir / "config.json").write_text((model_dir / "config.json").read_text() + " ")
    with pytest.raises(RuntimeError, match="differs on this node"):
        materialize(source, lambda ref: {})
    with pytest.raises(RuntimeError, match="declared shared"):
        materialize(ModelSource(str(tmp_path / "missing"), source.digest, shared_path=True), lambda ref: {})


def test_shipped_files_cannot_escape_the_model_directory(model_dir, tmp_path):
    evil = {"../evil.py": b""}
    source = ModelSource(str(tmp_path / "elsewhere"), files_digest(evil), files="ref")
    with pytest.raises(ValueError, match="outside the model directory"):
        materialize(source, lambda ref: evil, cache_dir=tmp_path / "cache" / "models")
    assert not (tmp_path / "cache" / "evil.py").exists()

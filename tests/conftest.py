"""Shared fixtures: small random-weight models built once per test session, and HF references."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import TEST_PRESETS, VISION_PRESETS, HFReference, HFVisionReference
from transformers import AutoTokenizer, LlamaForCausalLM

from pdserve.engine.models.draft_training import draft_from_target
from pdserve.engine.models.presets import make_model
from pdserve.router.event_loop import EventLoopThread

# The tests' own torch work (transformers' reference outputs, in-process engines) on one thread, as each
# worker of a test cluster runs: on the CI machine's two cores a second thread only competes with the
# cluster's processes.
torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The cluster tests first, then the fuzz tests (the longest of the rest, about 100 s). `make test`
    hands whole files to its two processes in collection order (`--no-loadscope-reorder`); a long file
    handed out last would leave the other process idle while it runs, and the short files after them
    fill the gaps."""
    items.sort(key=lambda item: (not item.nodeid.startswith("tests/cluster/"), "fuzz" not in item.nodeid))


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: make_model(name, root / name, seed=0) for name in TEST_PRESETS}


@pytest.fixture(scope="session")
def tiny_llama_draft(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A draft model for tiny-llama: its first layer, embeddings and head (untrained: agrees at times)."""
    target = model_dirs["tiny-llama"]
    out = tmp_path_factory.mktemp("draft") / "tiny-llama-draft"
    draft_from_target(LlamaForCausalLM.from_pretrained(target, dtype=torch.float32), 1).save_pretrained(out)
    AutoTokenizer.from_pretrained(target).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def hf_reference(model_dirs: dict[str, Path]) -> dict[str, HFReference]:
    return {name: HFReference(path) for name, path in model_dirs.items()}


@pytest.fixture(scope="session")
def vision_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The vision-language presets, built once."""
    root = tmp_path_factory.mktemp("vision-models")
    return {name: make_model(name, root / name, seed=0) for name in VISION_PRESETS}


@pytest.fixture(scope="session")
def vision_references(vision_models: dict[str, Path]) -> dict[str, HFVisionReference]:
    return {name: HFVisionReference(path) for name, path in vision_models.items()}


@pytest.fixture(scope="module")
def router_loop() -> Iterator[EventLoopThread]:
    """An event loop on a thread of its own, as the router runs one: its hubs receive on it, and a
    test runs its streams' side there (`router_loop.run(coroutine)`)."""
    loop = EventLoopThread("test-router-loop")
    yield loop
    loop.stop()

"""One model, the same bytes on every node: a digest of a model directory, and its materialization on
a node that may not have it.

The launcher describes the served model as a `ModelSource` (what the manifest named, the digest of the
directory it resolved, and, unless the path is declared shared, a way to fetch the directory's files).
Each worker materializes it on its own node (`materialize`): a shipped or preset model is resolved
there (presets are built deterministically from their seed, so every node gets the same bytes); a
directory is used where it already exists with the right digest, else written from the fetched files
into the node's cache. Either way the result's digest must equal the launcher's, or the worker refuses
to start: no two workers ever serve different weights.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.engine.presets import MARKER, default_cache_dir, resolve_model

CHUNK = 1 << 20


@dataclass(frozen=True)
class ModelSource:
    spec: str  # as the manifest names it: a shipped model, a preset, or a directory
    digest: str  # of the directory the launcher resolved (`model_digest`)
    shared_path: bool = False  # a directory every node reads at the same path (no shipping)
    files: Any = None  # what the worker passes to its fetch function for the directory's files (a Ray ref)


def model_files(model_dir: str | Path) -> list[Path]:
    """The files that make the model (weights, config, tokenizer), relative to its directory, sorted.
    The preset marker (build bookkeeping) and hidden files are not part of it."""
    root = Path(model_dir)
    return sorted(p.relative_to(root) for p in root.rglob("*")
                  if p.is_file() and p.name != MARKER and not any(part.startswith(".") for part in p.parts))


def model_digest(model_dir: str | Path) -> str:
    """SHA-256 over every model file's relative path and bytes."""
    root, h = Path(model_dir), hashlib.sha256()
    for rel in model_files(root):
        h.update(str(rel).encode() + b"\0")
        with open(root / rel, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def read_model_files(model_dir: str | Path) -> dict[str, bytes]:
    """The model's files as {relative path: bytes}, for shipping to nodes that lack the directory."""
    root = Path(model_dir)
    return {str(rel): (root / rel).read_bytes() for rel in model_files(root)}


def materialize(source: ModelSource, fetch: Callable[[Any], dict[str, bytes]],
                cache_dir: Path | None = None) -> Path:
    """The model's directory on this node, checked against the launcher's digest; raises RuntimeError
    when this node's copy differs (or cannot be had) and names both digests."""
    path = Path(source.spec)
    if source.shared_path and not path.is_dir():
        raise RuntimeError(f"model directory {source.spec!r} is declared shared (model_path_shared) but this "
                           "node does not have it")
    if path.is_dir() or source.files is None:
        model_dir = resolve_model(source.spec)  # a shipped model, a preset built here, or the path itself
    else:  # a directory this node lacks: write the shipped files into its cache, once per digest
        model_dir = (cache_dir or default_cache_dir()).parent / "shipped" / source.digest
        if not model_dir.is_dir():
            _write(model_dir, fetch(source.files))
    got = model_digest(model_dir)
    if got != source.digest:
        raise RuntimeError(f"model {source.spec!r} differs on this node: {model_dir} has digest {got[:16]}..., "
                           f"the launcher's is {source.digest[:16]}... (a path declared shared that is not, "
                           "or a stale copy)")
    return model_dir


def _write(target: Path, files: dict[str, bytes]) -> None:
    """Write the files into a staging directory, then move it into place (atomically, so a half-written
    copy is never taken for the model)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent)).resolve()
    try:
        for rel, data in files.items():
            out = (staging / rel).resolve()
            if staging not in out.parents:
                raise ValueError(f"shipped model file {rel!r} would land outside the model directory")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)
        os.rename(staging, target)
    except OSError:
        if not target.is_dir():
            raise
        # another worker on this node moved its copy in first: keep that one
    finally:
        shutil.rmtree(staging, ignore_errors=True)

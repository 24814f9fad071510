"""One model, the same bytes on every node: a digest of a model directory, and its materialization on
a node that may not have it.

The launcher describes the served model as a `ModelSource` (what the manifest named, the digest of the
directory it resolved, and, unless the path is declared shared, a way to fetch the directory's files).
Each worker materializes it on its own node (`materialize`): a shipped or preset model is resolved
there (presets are built deterministically from their seed, so every node gets the same bytes); a
directory is used where it exists with the right digest, else taken from the shipped files into the
node's cache (once per node). Either way the result's digest must equal the launcher's, or the worker
refuses to start: no two workers ever serve different weights. On a single machine there is one copy
and nothing is hashed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.engine.models.presets import MARKER, default_cache_dir, resolve_model

CHUNK = 1 << 20


@dataclass(frozen=True)
class ModelSource:
    spec: str  # a shipped model or preset name, or a directory's absolute path
    digest: str  # of the directory the launcher resolved (`model_digest`); "" when not to be checked
    shared_path: bool = False  # a directory every node reads at the same path (no shipping)
    files: Any = None  # what the worker passes to its fetch function for the directory's files (a Ray ref)


def model_files(model_dir: str | Path) -> list[Path]:
    """The files that make the model (weights, config, tokenizer), relative to its directory, sorted.
    The preset marker (build bookkeeping) and hidden files inside it are not part of it."""
    root = Path(model_dir)
    rels = (p.relative_to(root) for p in root.rglob("*") if p.is_file())
    return sorted(r for r in rels if r.name != MARKER and not any(part.startswith(".") for part in r.parts))


def model_digest(model_dir: str | Path) -> str:
    """SHA-256 over every model file's relative path, size and bytes (lengths first: no two file sets
    can run together into one stream)."""
    root, h = Path(model_dir), hashlib.sha256()
    for rel in model_files(root):
        with open(root / rel, "rb") as f:
            _hash_file(h, str(rel), (root / rel).stat().st_size, iter(lambda: f.read(CHUNK), b""))
    return h.hexdigest()


def files_digest(files: dict[str, bytes]) -> str:
    """`model_digest` of the directory these files (`read_model_files`) make, without reading it again."""
    h = hashlib.sha256()
    for rel in sorted(files, key=Path):  # the order model_files lists them in
        _hash_file(h, rel, len(files[rel]), [files[rel]])
    return h.hexdigest()


def _hash_file(h: Any, rel: str, size: int, chunks: Iterable[bytes]) -> None:
    name = rel.encode()
    h.update(len(name).to_bytes(8, "little") + name + size.to_bytes(8, "little"))
    for chunk in chunks:
        h.update(chunk)


def read_model_files(model_dir: str | Path) -> dict[str, bytes]:
    """The model's files as {relative path: bytes}, for shipping to nodes that lack the directory."""
    root = Path(model_dir)
    return {str(rel): (root / rel).read_bytes() for rel in model_files(root)}


def materialize(source: ModelSource, fetch: Callable[[Any], dict[str, bytes]],
                cache_dir: Path | None = None) -> tuple[Path, str]:
    """The model's directory on this node, and its digest (that of the launcher, or "" unchecked). A
    directory this node lacks, or holds with other bytes, is taken from the shipped files when there are
    any; else RuntimeError names both digests."""
    path = Path(source.spec)
    if source.shared_path and not path.is_dir():
        raise RuntimeError(f"model directory {source.spec!r} is declared shared (model_path_shared) but this "
                           "node does not have it")
    if not source.digest:  # one copy for the whole cluster (a single machine): nothing to compare
        return resolve_model(source.spec), ""
    if source.files is None or path.is_dir():
        model_dir = resolve_model(source.spec)  # a shipped model, a preset built here, or the path itself
        got = model_digest(model_dir)
        if got == source.digest:
            return model_dir, got
        if source.files is None:
            raise RuntimeError(f"model {source.spec!r} differs on this node: {model_dir} has digest {got[:16]}..., "
                               f"the launcher's is {source.digest[:16]}... (a path declared shared that is not, "
                               "a stale copy, or another pdserve version)")
    # A directory this node lacks or holds otherwise: the shipped files, in the node's cache once per digest.
    shipped = (cache_dir or default_cache_dir()).parent / "shipped"
    shipped.mkdir(parents=True, exist_ok=True)
    target = shipped / source.digest
    with open(shipped / f".{source.digest}.lock", "w") as lock:  # one fetch per node, not one per worker
        fcntl.flock(lock, fcntl.LOCK_EX)
        got = model_digest(target) if target.is_dir() else ""
        if got != source.digest:  # missing, or a damaged copy: written again
            files = fetch(source.files)
            got = files_digest(files)
            if got == source.digest:
                shutil.rmtree(target, ignore_errors=True)
                _write(target, files)
    if got != source.digest:
        raise RuntimeError(f"the model files shipped for {source.spec!r} have digest {got[:16]}..., not the "
                           f"launcher's {source.digest[:16]}...")
    return target, got


def _write(target: Path, files: dict[str, bytes]) -> None:
    """Write the files into a staging directory, then move it into place (atomically: a worker that
    dies halfway leaves no directory that looks like the model)."""
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
    finally:
        shutil.rmtree(staging, ignore_errors=True)

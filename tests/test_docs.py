"""The documentation: the site builds without a warning (broken links and anchors included), and the
configuration reference is the one the manifest's schema renders, every field described."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pdserve.cluster import manifest_docs

ROOT = Path(__file__).resolve().parent.parent


def test_the_docs_site_builds_strict_without_a_warning(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # Material's notice about its successor, not a finding
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    assert "WARNING" not in log, log
    for page in ("index.html", "configuration-reference/index.html", "benchmarks/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


def test_every_manifest_field_has_a_description() -> None:
    assert manifest_docs.undocumented() == [], "add Field(description=...) in cluster/manifest.py"


def test_a_field_without_a_description_is_found() -> None:
    from pydantic import BaseModel, Field

    class Inner(BaseModel):
        described: int = Field(0, description="yes")
        bare: int = 0

    class Outer(BaseModel):
        inner: Inner | None = Field(None, description="a section")

    assert manifest_docs.undocumented(Outer) == ["inner.bare"]


def test_the_configuration_reference_is_current() -> None:
    committed = (ROOT / "docs" / "configuration-reference.md").read_text()
    assert committed == manifest_docs.render(), (
        "docs/configuration-reference.md is stale: run `python -m pdserve.cluster.manifest_docs`")


def test_the_reference_lists_every_field_with_its_type_and_default() -> None:
    page = manifest_docs.render()
    assert "| `pools.decode.replicas` | int, ≥ 0, ≤ 64 | `1` |" in page
    assert '| `kv_transfer.transport` | "auto" \\| "shm"' in page
    assert "| `kv_transfer.tls.cert` | path | required |" in page
    assert "| `server.auth_token` | str (secret) \\| null | `null` |" in page

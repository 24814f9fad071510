"""One import name, `pdserve`; the base install is the SDK alone; the boundaries between the parts hold.

A wheel is built from a clean copy of the checkout (no stale build output can leak in) and used
three ways: installed with --no-deps into a fresh virtual environment that has grpcio and protobuf
and nothing else (no torch, ray, numpy or pyzmq); compared against the folders it must contain; and
unpacked for import-linter, whose graph builder needs the installed layout on disk.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
OLD_TOP_LEVEL = {name.split(".")[1] for name in PACKAGE_DIRS if "." in name}  # engine, router, proto, ...


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".venv", "bench-results", ".whl", ".gl"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(work / "dist"), str(src)], check=True, timeout=300)
    return next((work / "dist").glob("pdserve-*.whl"))


@pytest.fixture(scope="module")
def client_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the base install and, linked from this environment, grpcio + protobuf only."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, with_pip=True, symlinks=True)
    python = env_dir / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, timeout=300)
    site = Path(subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    import google.protobuf
    import grpc
    import typing_extensions  # grpcio's one requirement

    for source in (Path(grpc.__file__).parent, Path(google.protobuf.__file__).parent.parent,
                   Path(typing_extensions.__file__)):
        (site / source.name).symlink_to(source)
    return python


def test_the_distribution_installs_one_top_level_name(client_venv: Path) -> None:
    code = """
import importlib.metadata as md
dist = md.distribution("pdserve")
names = {f.parts[0] for f in dist.files if not f.parts[0].endswith(".dist-info") and f.parts[0] != ".."}
declared = set((dist.read_text("top_level.txt") or "").split())
print(sorted(names), sorted(declared))
"""
    out = subprocess.check_output([str(client_venv), "-c", code], text=True, timeout=60, cwd=client_venv.parent).strip()
    assert out == "['pdserve'] ['pdserve']", out


def test_import_pdserve_gives_the_sdk_without_torch(client_venv: Path) -> None:
    code = """
import importlib.util, sys
assert importlib.util.find_spec("torch") is None, "torch must be absent from this venv"
import pdserve
client = pdserve.Client("127.0.0.1:1", timeout=0.5)
try:
    client.model_info()
except pdserve.Unavailable as e:
    print("unavailable:", e.code.name)
client.close()
assert issubclass(pdserve.InvalidArgument, pdserve.PDServeError) and pdserve.AsyncClient
heavy = {"torch", "ray", "numpy", "zmq", "transformers"} & set(sys.modules)
assert not heavy, heavy
"""
    # cwd outside the checkout: `python -c` puts cwd first on sys.path, and the checkout has a pdserve/.
    result = subprocess.run([str(client_venv), "-c", code], capture_output=True, text=True, timeout=60,
                            cwd=client_venv.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "unavailable: UNAVAILABLE"


def test_the_wheel_holds_every_module_of_every_part(wheel: Path) -> None:
    in_wheel = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    expected = set()
    for package, folder in PACKAGE_DIRS.items():
        for path in (ROOT / folder).rglob("*.py"):
            expected.add("/".join([*package.split("."), *path.relative_to(ROOT / folder).parts]))
    assert not expected - in_wheel, f"missing from the wheel (add the package to pyproject.toml): " \
                                    f"{sorted(expected - in_wheel)}"


def test_an_installed_package_finds_its_default_manifest(wheel: Path, tmp_path: Path) -> None:
    """`pdserve up` and `pdserve demo` without a manifest, from a wheel (a ray-up node, the KubeRay image)."""
    zipfile.ZipFile(wheel).extractall(tmp_path)
    code = "from pdserve.cluster.manifest import DEFAULT_MANIFEST, load_manifest; load_manifest(); print(DEFAULT_MANIFEST)"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == tmp_path / "pdserve" / "deploy" / "local.yaml"


def test_import_contracts_hold(wheel: Path, tmp_path: Path) -> None:
    zipfile.ZipFile(wheel).extractall(tmp_path)
    lint = Path(sys.executable).with_name("lint-imports")  # this interpreter's, not any on PATH
    assert lint.is_file(), "lint-imports is not installed (the test extra)"
    result = subprocess.run([lint, "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)})
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_nothing_imports_the_old_top_level_names() -> None:
    python_files = [p for folder in [*PACKAGE_DIRS.values(), "tests"] for p in (ROOT / folder).rglob("*.py")]
    offenders = []
    for path in python_files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                     else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names
                          if n.split(".")[0] in OLD_TOP_LEVEL]
    # Old module names in commands (`python -m` of one) and in code shown by the README and docs.
    old = "|".join(sorted(OLD_TOP_LEVEL))
    pattern = re.compile(rf"(?:-m\s+|^\s*from\s+|^\s*import\s+)(?:{old})(?:\.\w+)*(?=\s|$)", re.M)
    texts = [*python_files, ROOT / "README.md", ROOT / "Makefile", ROOT / ".ci" / "run", *(ROOT / "docs").glob("*.md")]
    for path in texts:
        for match in pattern.finditer(path.read_text()):
            line = path.read_text().count("\n", 0, match.start()) + 1
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0).strip()}")
    assert not offenders, "use the `pdserve.` names: " + ", ".join(offenders)


def test_the_router_side_imports_without_torch() -> None:
    """What import-linter cannot see: running a module runs its packages' __init__ too."""
    code = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('torch', 'transformers', 'ray'):
            raise ImportError(name + ' is blocked in this test')
sys.meta_path.insert(0, Block())
import pdserve, pdserve.router.server, pdserve.router.service, pdserve.router.token_hub, pdserve.wire
from pdserve.engine.sampling_params import SamplingParams
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr

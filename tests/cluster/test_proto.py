"""The checked-in generated code is what `python -m pdserve.proto.generate` makes now, and it imports
under the `pdserve` namespace. (That the SDK imports without torch: tests/test_packaging.py.)"""

from __future__ import annotations

import importlib
import subprocess
from pathlib import Path

import pytest
import torch

from pdserve.proto.generate import PROTO_DIR, generate


def test_generated_code_is_current(tmp_path):
    fresh = generate(tmp_path)
    assert fresh, "protoc generated nothing"
    for path in fresh:
        checked_in = PROTO_DIR / path.relative_to(tmp_path)
        assert checked_in.is_file(), f"{checked_in} is missing: run `python -m pdserve.proto.generate`"
        assert checked_in.read_bytes() == path.read_bytes(), \
            f"{checked_in} is stale: run `python -m pdserve.proto.generate`"


def test_generated_modules_import_under_the_namespace():
    for path in sorted(PROTO_DIR.rglob("*_pb2*.py")):
        name = "pdserve.proto." + ".".join(path.relative_to(PROTO_DIR).with_suffix("").parts)
        module = importlib.import_module(name)  # a *_pb2_grpc module imports its *_pb2 by that name
        if name.endswith("_pb2"):
            source = path.relative_to(PROTO_DIR).with_name(path.name.removesuffix("_pb2.py") + ".proto")
            assert module.DESCRIPTOR.name == f"pdserve/proto/{source.as_posix()}"


def _modules() -> list:
    return [importlib.import_module("pdserve.proto." + ".".join(p.relative_to(PROTO_DIR).with_suffix("").parts))
            for p in sorted(PROTO_DIR.rglob("*_pb2.py"))]


def test_every_proto_names_its_package_for_the_languages_clients_are_written_in():
    """A client in another language builds from the .proto files alone: protoc-gen-go refuses a file
    without go_package, and a Java outer class named like a type in the file breaks builds on
    case-insensitive file systems."""
    go_packages = set()
    for module in _modules():
        options = module.DESCRIPTOR.GetOptions()
        assert options.go_package and options.java_multiple_files and options.csharp_namespace, \
            module.DESCRIPTOR.name
        names = {n.lower() for n in [*module.DESCRIPTOR.message_types_by_name,
                                     *module.DESCRIPTOR.services_by_name, *module.DESCRIPTOR.enum_types_by_name]}
        assert options.java_outer_classname.lower() not in names, module.DESCRIPTOR.name
        go_packages.add(options.go_package)
    assert len(go_packages) == 1  # one proto package, one Go package


def test_the_protos_compile_alone_for_other_languages(tmp_path):
    """With protoc's own C++, Java and C# generators (torch's wheel ships a full protoc; grpcio-tools'
    has only Python's), from the proto folder as include root and nothing else."""
    protoc = Path(torch.__file__).parent / "bin" / "protoc"
    if not protoc.is_file():
        pytest.skip("no full protoc here")
    sources = [str(p.relative_to(PROTO_DIR)) for p in sorted(PROTO_DIR.rglob("*.proto"))]
    for language in ("cpp", "java", "csharp"):
        out = tmp_path / language
        out.mkdir()
        result = subprocess.run([str(protoc), "--experimental_allow_proto3_optional", f"-I{PROTO_DIR}",
                                 f"--{language}_out={out}", *sources], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and not result.stderr, (language, result.stderr)
        assert any(out.rglob("*.*")), language

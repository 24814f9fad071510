"""The checked-in generated code is what `python -m pdserve.proto.generate` makes now, and it imports
under the `pdserve` namespace. (That the SDK imports without torch: tests/test_packaging.py.)"""

from __future__ import annotations

import importlib

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

"""Regenerate the Python code of the .proto files: `python -m proto.generate [OUT_DIR]`.

Run from the repository root. Code is generated with import paths rooted at the repository
(`proto.pdserve.v1...`), so the `proto` package is importable as installed.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = sorted(p.relative_to(ROOT) for p in (ROOT / "proto").rglob("*.proto"))


def generate(out_dir: Path = ROOT) -> list[Path]:
    include = resources.files("grpc_tools") / "_proto"
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *map(str, PROTOS)]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    return sorted(p for p in Path(out_dir).rglob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT):
        print(path)

"""Regenerate the Python code of the .proto files: `python -m pdserve.proto.generate [OUT_DIR]`.

The generated modules import each other as `pdserve.proto.pdserve.v1...`, their installed name. protoc
derives that from each file's path under its include root, so the .proto files are staged under
`pdserve/proto/` in a temporary root and compiled from there; the output is copied back next to the
sources (or into OUT_DIR, mirroring this folder).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

PROTO_DIR = Path(__file__).resolve().parent
IMPORT_PREFIX = Path("pdserve", "proto")  # where this folder is installed, as a path


def generate(out_dir: Path = PROTO_DIR) -> list[Path]:
    """Compile every .proto below this folder; return the files written under `out_dir`."""
    sources = sorted(p.relative_to(PROTO_DIR) for p in PROTO_DIR.rglob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        stage, build = Path(tmp, "src"), Path(tmp, "out")
        for rel in sources:
            (stage / IMPORT_PREFIX / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(PROTO_DIR / rel, stage / IMPORT_PREFIX / rel)
        build.mkdir()
        include = resources.files("grpc_tools") / "_proto"
        args = ["protoc", f"-I{stage}", f"-I{include}", f"--python_out={build}", f"--pyi_out={build}",
                f"--grpc_python_out={build}", *(str(IMPORT_PREFIX / rel) for rel in sources)]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed: " + " ".join(args))
        written = []
        for made in sorted((build / IMPORT_PREFIX).rglob("*_pb2*.py*")):
            target = Path(out_dir) / made.relative_to(build / IMPORT_PREFIX)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(made, target)
            written.append(target)
    return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR):
        print(path)

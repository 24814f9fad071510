"""Generated code is current; the SDK imports with only grpcio and protobuf."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from proto.generate import ROOT, generate

BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in ('torch', 'ray', 'transformers', 'numpy', 'zmq'):
            raise ImportError(f'{name} is blocked in this test')
sys.meta_path.insert(0, Block())
"""


def test_generated_code_is_current(tmp_path):
    fresh = generate(tmp_path)
    assert fresh, "protoc generated nothing"
    for path in fresh:
        checked_in = ROOT / path.relative_to(tmp_path)
        assert checked_in.is_file(), f"{checked_in} is missing: run `python -m proto.generate`"
        assert checked_in.read_bytes() == path.read_bytes(), f"{checked_in} is stale: run `python -m proto.generate`"


def test_sdk_imports_without_torch_or_ray():
    code = BLOCKER + """
from router.client import AsyncClient, Client, InvalidArgument, Unavailable
client = Client("127.0.0.1:1", timeout=0.5)
try:
    client.model_info()
except Unavailable:
    pass
client.close()
assert not {'torch', 'ray', 'transformers', 'numpy'} & set(sys.modules), sorted(sys.modules)
print('ok')
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            cwd=Path(ROOT))
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr

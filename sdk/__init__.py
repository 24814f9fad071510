"""pdserve: a disaggregated prefill/decode serving runtime. `import pdserve` is the client SDK.

    import pdserve

    with pdserve.Client("127.0.0.1:50051") as client:
        print(client.generate("The water was", max_tokens=16, temperature=0).text)

The SDK needs only grpcio and protobuf. The server side lives in the subpackages (`pdserve.engine`
for the offline engine, `pdserve.cluster` for the cluster and the `pdserve` command) and needs the
`server` extra.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.client import (
        AsyncClient,
        Cancelled,
        Client,
        Completion,
        DeadlineExceeded,
        InsecureTokenWarning,
        InvalidArgument,
        NotFound,
        PDServeError,
        ResourceExhausted,
        StreamChunk,
        Unauthenticated,
        Unavailable,
    )

__all__ = [
    "Client", "AsyncClient", "Completion", "StreamChunk", "PDServeError", "InvalidArgument", "NotFound",
    "Unavailable", "ResourceExhausted", "DeadlineExceeded", "Cancelled", "Unauthenticated", "InsecureTokenWarning",
]


def __getattr__(name: str) -> Any:
    """The SDK's names, loaded on first use (PEP 562): `import pdserve.cluster.cli` then loads no gRPC
    before the command has set gRPC's environment (cluster/cli.py)."""
    if name in __all__:
        return getattr(importlib.import_module("pdserve.client"), name)
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")

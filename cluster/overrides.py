"""Command-line overrides of a manifest's common settings (`pdserve up --model ... --decode-replicas 2`):
what vLLM's and SGLang's users change on each start, without copying a YAML file for it.

Each override is written into the manifest's data before it is validated, so a bad value is refused
like a bad manifest field, and the error names the option it came from.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass, fields
from typing import Any, Literal

from pdserve.diagnostics import LogLevel


@dataclass(frozen=True)
class Override:
    """One option and the manifest field it sets."""

    option: str  # as typed: --decode-replicas
    field: tuple[str, ...]  # the manifest field's path: ("pools", "decode", "replicas")


OVERRIDES = {  # ManifestOverrides' attribute -> its option and field
    "model": Override("--model", ("model",)),
    "served_model_name": Override("--served-model-name", ("served_model_name",)),
    "mode": Override("--mode", ("mode",)),
    "prefill_replicas": Override("--prefill-replicas", ("pools", "prefill", "replicas")),
    "decode_replicas": Override("--decode-replicas", ("pools", "decode", "replicas")),
    "grpc_address": Override("--grpc-address", ("server", "address")),
    "http_address": Override("--http-address", ("server", "http_address")),
    "log_level": Override("--log-level", ("log_level",)),
}


@dataclass(frozen=True)
class ManifestOverrides:
    """The overrides given; None: the manifest's own value stands."""

    model: str | None = None
    served_model_name: str | None = None
    mode: Literal["disaggregated", "colocated"] | None = None
    prefill_replicas: int | None = None
    decode_replicas: int | None = None
    grpc_address: str | None = None
    http_address: str | None = None
    log_level: LogLevel | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ManifestOverrides:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def given(self) -> dict[str, Any]:
        """attribute -> value, of the overrides given."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def apply(self, data: dict[str, Any]) -> dict[str, Any]:
        """A copy of a manifest's data with the overrides written in (the data itself is left as it is)."""
        out = copy.deepcopy(data)
        for name, value in self.given().items():
            *parents, leaf = OVERRIDES[name].field
            target = out
            for part in parents:
                if not isinstance(target.get(part), dict):  # absent or null in the file: its defaults
                    target[part] = {}
                target = target[part]
            target[leaf] = value
        return out

    def option_for(self, field: str) -> str | None:
        """The option that set the manifest field at dotted path `field`, when one did."""
        for name in self.given():
            if field == ".".join(OVERRIDES[name].field):
                return OVERRIDES[name].option
        return None


def add_override_options(parser: argparse.ArgumentParser) -> None:
    """The override options, on `parser` (`pdserve up`)."""
    group = parser.add_argument_group("overrides", "set a manifest field for this start, over the manifest's value")
    group.add_argument("--model", help="a shipped model, a preset, a model directory or a Hugging Face Hub id "
                                       "(model). Example: --model Qwen/Qwen2.5-0.5B-Instruct")
    group.add_argument("--served-model-name", metavar="NAME",
                       help="the name clients call the model by (served_model_name). Example: --served-model-name "
                            "my-model")
    group.add_argument("--mode", metavar="{disaggregated,colocated}", help="mode. Example: --mode colocated")
    group.add_argument("--prefill-replicas", type=int, metavar="N",
                       help="prefill workers (pools.prefill.replicas). Example: --prefill-replicas 2")
    group.add_argument("--decode-replicas", type=int, metavar="N",
                       help="decode workers (pools.decode.replicas). Example: --decode-replicas 4")
    group.add_argument("--grpc-address", metavar="HOST:PORT",
                       help="the gRPC API's address (server.address). Example: --grpc-address 0.0.0.0:50051")
    group.add_argument("--http-address", metavar="HOST:PORT",
                       help="the OpenAI API's address (server.http_address). Example: --http-address 0.0.0.0:8000")
    group.add_argument("--log-level", metavar="{debug,info,warning,error}",
                       help="diagnostics at this level and above, from every part (log_level). Example: --log-level "
                            "info")

"""The model runtime shared by the prefill and decode pools (no Ray, no gRPC here).

    from pdserve.engine import LLM, SamplingParams

Names are imported on first use (PEP 562), so that `pdserve.engine.sampling_params`, which the
router and the wire module need, can be imported without torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.kv_cache import KVBlocks
    from pdserve.engine.llm import LLM
    from pdserve.engine.llm_engine import LLMEngine, RequestHandoff
    from pdserve.engine.models.presets import PRESETS, make_model, resolve_model
    from pdserve.engine.sampling_params import RequestOutput, SamplingParams

_EXPORTS = {
    "LLM": "llm", "LLMEngine": "llm_engine", "RequestHandoff": "llm_engine", "EngineConfig": "config",
    "SamplingParams": "sampling_params", "RequestOutput": "sampling_params", "KVBlocks": "kv_cache",
    "PRESETS": "models.presets", "make_model": "models.presets", "resolve_model": "models.presets",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""The model runtime shared by the prefill and decode pools (no Ray, no gRPC here)."""

from engine.config import EngineConfig
from engine.kv_cache import KVBlocks
from engine.llm import LLM
from engine.llm_engine import LLMEngine, RequestHandoff
from engine.presets import PRESETS, make_model, resolve_model
from engine.sampling_params import RequestOutput, SamplingParams

__all__ = [
    "LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "RequestHandoff", "KVBlocks",
    "PRESETS", "make_model", "resolve_model",
]

from megatron.core.inference.engines.abstract_engine import AbstractEngine
from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine, EngineSuspendedError
from megatron.core.inference.engines.static_engine import StaticInferenceEngine

__all__ = ["AbstractEngine", "DynamicInferenceEngine", "EngineSuspendedError", "StaticInferenceEngine"]

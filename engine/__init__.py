"""Model execution shared by prefill and decode: models, paged KV cache, scheduler, sampler, MoE.

Public API: ``from engine import LLM, SamplingParams``. The engine must not import any service package.
"""

from engine.config import EngineConfig
from engine.llm import LLM, ClassificationOutput, CompletionOutput, EmbeddingOutput, ScoringOutput
from engine.llm_engine import LLMEngine, RequestOutput
from engine.lora import LoRARequest
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "ClassificationOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EngineConfig",
    "LLMEngine",
    "LoRARequest",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "ScoringOutput",
]

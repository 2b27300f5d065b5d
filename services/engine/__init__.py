"""pdserve's engine: paged KV cache, continuous batching, Llama-family models.

``from services.engine import LLM, SamplingParams`` for offline generation (``BeamSearchParams``
for ``LLM.beam_search``); ``EngineCore`` is the step-wise engine (``add_request``, ``step``,
``abort``) that the prefill and decode nodes drive.
"""

from services.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from services.engine.config import (
    CacheConfig,
    EngineConfig,
    LoraConfig,
    SchedulerConfig,
    SchedulingPolicy,
    SpeculativeConfig,
    default_max_num_batched_tokens,
)
from services.engine.engine_core import EngineCore, LoraCapacityError
from services.engine.llm import LLM
from services.engine.logprob import Logprob
from services.engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    EngineCoreOutput,
    EngineStats,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from services.engine.scheduler import Reservation
from services.types import (
    EngineConfigError,
    FinishReason,
    PoolingParams,
    SamplingParams,
    StructuredOutputsParams,
)
from services.types.lora_request import LoRARequest

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CacheConfig",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineConfig",
    "EngineConfigError",
    "EngineCore",
    "EngineCoreOutput",
    "EngineStats",
    "FinishReason",
    "LoraCapacityError",
    "LoraConfig",
    "LoRARequest",
    "Logprob",
    "PoolingParams",
    "RequestOutput",
    "Reservation",
    "SamplingParams",
    "SchedulerConfig",
    "SchedulingPolicy",
    "SpeculativeConfig",
    "ScoringOutput",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
    "default_max_num_batched_tokens",
]

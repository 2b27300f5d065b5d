"""pdserve's one torch-free vocabulary, shared by the engine, the nodes, the gateway and deploy.

Pure Python (no torch, numpy, grpc or protobuf; an import contract keeps it so): the gateway
image runs without torch, and the engine's scheduler imports these too. Protobuf conversion
lives at the gRPC edge, in ``services.convert``.
"""

from services.types.engine_config_error import EngineConfigError
from services.types.finish_reason import FinishReason
from services.types.limits import MAX_LOGPROBS
from services.types.pooling_params import PoolingParams
from services.types.role import Role
from services.types.sampling_param_error import SamplingParamError
from services.types.sampling_params import SamplingParams
from services.types.stage_timings import StageTimings
from services.types.structured_outputs import StructuredOutputsParams
from services.types.token_logprob import TokenLogprob
from services.types.usage import Usage

__all__ = [
    "MAX_LOGPROBS",
    "EngineConfigError",
    "FinishReason",
    "PoolingParams",
    "Role",
    "SamplingParamError",
    "SamplingParams",
    "StageTimings",
    "StructuredOutputsParams",
    "TokenLogprob",
    "Usage",
]

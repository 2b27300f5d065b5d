"""What an embedding request asks of its prompt's hidden states: vLLM's ``PoolingParams``."""

from __future__ import annotations

from dataclasses import dataclass

from services.types.sampling_param_error import SamplingParamError


@dataclass(frozen=True)
class PoolingParams:
    """The embedding of a prompt: the final hidden state (after the model's last norm) of its
    last token, as decoder embedding models (Qwen3-Embedding, e5-mistral, gte-Qwen2) pool;
    its first ``dimensions`` values only where given (Matryoshka), then L2-normalized where
    ``normalize`` is True; None: as the model's sentence-transformers modules do (a Normalize
    module listed), normalized for a model without them, as vLLM does. Bad values raise
    ``SamplingParamError`` naming the field."""

    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise SamplingParamError(
                "normalize", f"normalize must be a bool or None, got {self.normalize!r}"
            )
        dimensions = self.dimensions
        if dimensions is not None and (
            isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1
        ):
            raise SamplingParamError(
                "dimensions", f"dimensions must be a positive integer, got {dimensions!r}"
            )

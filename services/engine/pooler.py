"""Embeddings from the last prompt token's final hidden state (``PoolingParams``): last-token
pooling, as decoder embedding models are trained (Qwen3-Embedding, e5-mistral, gte-Qwen2).
Mean or CLS pooling would need every prompt position's hidden state, which the prefix cache
skips; they are not built."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.types import PoolingParams


def pool_last_tokens(final_hidden: torch.Tensor, params: list[PoolingParams]) -> list[list[float]]:
    """final_hidden: ``[num_requests, hidden_size]``, each row a prompt's last token after the
    model's final norm; one embedding per row, in float32: its first ``dimensions`` values
    (Matryoshka), L2-normalized where ``normalize`` is True (the engine has set every None to
    the model's default)."""
    rows = final_hidden.float()
    embeddings: list[list[float]] = []
    for row, pooling in zip(rows, params, strict=True):
        if pooling.dimensions is not None:
            row = row[: pooling.dimensions]
        if pooling.normalize:
            row = F.normalize(row, dim=-1)
        embeddings.append(row.tolist())
    return embeddings

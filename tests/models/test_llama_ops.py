"""The decoder's elementwise pieces give transformers' bits: RMSNorm and rotary embeddings are
rewritten for speed (fewer casts, tables looked up once a step), never for different numbers."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from services.models.llama import RMSNorm
from services.models.rotary import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 2048])
def test_rms_norm_matches_transformers_bits(dtype: torch.dtype, num_tokens: int) -> None:
    generator = torch.Generator().manual_seed(num_tokens)
    hidden = 768
    x = (torch.randn(num_tokens, hidden, generator=generator) * 4).to(dtype)
    weight = torch.randn(hidden, generator=generator).to(dtype)
    ours, theirs = RMSNorm(hidden, 1e-5).to(dtype), LlamaRMSNorm(hidden, 1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
        assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_tables_match_transformers_bits(dtype: torch.dtype) -> None:
    head_dim, num_tokens = 64, 300
    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, None)
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 4096, (num_tokens,), generator=generator)
    query = torch.randn(num_tokens, 12, head_dim, generator=generator).to(dtype)
    key = torch.randn(num_tokens, 4, head_dim, generator=generator).to(dtype)

    q, k = rotary.tables(positions, dtype).apply(query, key)

    # transformers: [batch, heads, tokens, head_dim] with cos/sin [batch, tokens, head_dim] cast
    # to the activations' dtype.
    cos = rotary.cos[positions].to(dtype)[None]
    sin = rotary.sin[positions].to(dtype)[None]
    q_ref, k_ref = apply_rotary_pos_emb(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos, sin
    )
    assert torch.equal(q, q_ref[0].transpose(0, 1))
    assert torch.equal(k, k_ref[0].transpose(0, 1))

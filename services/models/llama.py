"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flattened, paged batch.

Inputs are flat: a step's tokens from every request are concatenated, ``[num_tokens]``, and
attention finds each request's context through ``AttentionMetadata``. Q/K/V and gate/up
projections are fused into one matmul each (the loader splits the checkpoint's weights in).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.models.attention import AttentionBackend, AttentionMetadata
from services.models.config import ModelConfig
from services.models.rotary import RopeTables, RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, round to the input dtype, then scale: the order transformers
        # uses. torch's rms_norm computes a bf16 input in float32 and rounds once, so it gives
        # the bits of rms_norm(x.float()).to(x.dtype) without the two casts (a 2048 x 768 bf16
        # prefill chunk: 1.5 ms against 1.9 ms on 2 CPU cores; tests/models/test_llama_ops.py).
        # Without the weight: scaling before the rounding would change the bits.
        return self.weight * F.rms_norm(x, self.weight.shape, eps=self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.backend = backend

    def forward(
        self,
        rope: RopeTables,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, k)
        out = self.backend.forward(q, k, v, kv_cache, metadata)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        # In place: one [num_tokens, intermediate] temporary fewer.
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.self_attn = Attention(config, backend)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        rope: RopeTables,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), kv_cache, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, backend: AttentionBackend):
        super().__init__()
        # One rotary table shared by every layer.
        self.rotary = RotaryEmbedding(
            config.head_dim, max_positions, config.rope_theta, config.rope_scaling
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, backend: AttentionBackend):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_positions, backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens]. Returns hidden states [num_tokens, hidden_size]
        before the final norm (the caller keeps only the rows it samples from)."""
        hidden = self.model.embed_tokens(input_ids)
        rope = self.model.rotary.tables(positions, hidden.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            hidden = layer(rope, hidden, kv_cache, metadata)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_rows, hidden_size] → logits [num_rows, vocab_size] in float32."""
        return self.lm_head(self.model.norm(hidden)).float()

"""A loaded model's logits over one prompt, computed as a single prefill chunk on a scratch KV
cache: the loader tests' way of comparing two loads of a checkpoint."""

from __future__ import annotations

import torch

from services.models.attention import AttentionMetadata, PrefillSpan
from services.models.llama import LlamaForCausalLM


@torch.inference_mode()
def prefill_logits(
    model: LlamaForCausalLM, token_ids: list[int], block_size: int = 4
) -> torch.Tensor:
    """[len(token_ids), vocab_size]; ``block_size`` must be the model's attention backend's."""
    config = model.config
    num_tokens = len(token_ids)
    num_blocks = -(-num_tokens // block_size)
    kv_caches = [
        torch.zeros(2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        for _ in range(config.num_layers)
    ]
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens),
        num_decodes=0,
        decode_block_tables=torch.zeros(0, 0, dtype=torch.int64),
        decode_seq_lens=torch.zeros(0, dtype=torch.int64),
        prefills=[PrefillSpan(0, num_tokens, 0, torch.arange(num_blocks))],
    )
    hidden = model(torch.tensor(token_ids), torch.arange(num_tokens), kv_caches, metadata)
    return model.compute_logits(hidden)

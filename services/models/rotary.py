"""Rotary position embeddings (non-interleaved halves, as HF Llama), with Llama-3 scaling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from services.models.config import AnyRopeScaling, LinearRopeScaling, RopeFrequencyFactors


def rope_inv_freq(head_dim: int, theta: float, scaling: AnyRopeScaling | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, bit-for-bit as transformers computes them."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearRopeScaling):  # position interpolation
        return inv_freq / scaling.factor
    if isinstance(scaling, RopeFrequencyFactors):  # a GGUF file's rope_freqs, as llama.cpp
        return inv_freq / torch.tensor(scaling.factors, dtype=torch.float32, device="cpu")
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between
    # interpolated smoothly.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: AnyRopeScaling | None,
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float, device="cpu")
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # cos, sin: [max_positions, head_dim] float32, cast to the activations' dtype on use as
        # transformers does. Plain attributes, not buffers: they are computed on the CPU even when
        # the model is built on the meta device, and a dtype cast of the model must not touch them.
        self.cos = emb.cos()
        self.sin = emb.sin()

    def to_device(self, device: torch.device) -> None:
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """The cos and sin rows of a step's positions in the activations' dtype, looked up once
        per step and shared by every layer (a gather and two casts a layer otherwise)."""
        return RopeTables(
            cos=self.cos[positions].to(dtype)[:, None, :],
            sin=self.sin[positions].to(dtype)[:, None, :],
        )


@dataclass(frozen=True)
class RopeTables:
    """cos, sin: [num_tokens, 1, head_dim] in the activations' dtype, broadcast over heads."""

    cos: torch.Tensor
    sin: torch.Tensor

    def apply(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """query: [num_tokens, num_heads, head_dim]; key: [num_tokens, num_kv_heads, head_dim].
        The same ops in the same dtype as transformers' apply_rotary_pos_emb (same bits)."""
        cos, sin = self.cos, self.sin
        return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

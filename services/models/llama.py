"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM3, Granite, Phi-3, OLMo 2, Gemma 3,
and the mixtures of experts Mixtral and Qwen3-MoE) over a flattened, paged batch (``config.py``
says what each adds to Llama).

Inputs are flat: a step's tokens from every request are concatenated, ``[num_tokens]``, and
attention finds each request's context through ``AttentionMetadata``. Q/K/V and gate/up
projections are fused into one matmul each (the loader splits the checkpoint's weights in). The
elementwise steps (norms with the residual add, rotary, SiLU-and-mul) go through ``LayerOps``:
torch ops, or fused native kernels on the CPU (``native_layer_ops.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from services.models.attention import AttentionBackend, AttentionMetadata
from services.models.config import ModelConfig
from services.models.layer_ops import LayerOps
from services.models.lora import LoraGateUp
from services.models.packed_linear import PackedSiluGateUp
from services.models.rotary import RopeTables, RotaryEmbedding

_TORCH_OPS = LayerOps()


def _scaled(x: torch.Tensor, multiplier: float) -> torch.Tensor:
    """x times a model's multiplier (Granite's four, Gemma's embedding scale), in place (x is a
    fresh output); x itself where it is 1, as for most architectures."""
    return x if multiplier == 1.0 else x.mul_(multiplier)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., size]. The torch path (Qwen3's per-head q/k norms); a layer's own norms and
        the final norm of the rows sampled go through ``LayerOps.rms_norm``."""
        return _TORCH_OPS.rms_norm(x, None, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        ops: LayerOps,
        *,
        use_rope: bool,
        window: int | None = None,
    ):
        """``window``: attend to the last ``window`` tokens only (Gemma 3's sliding layers)."""
        super().__init__()
        self.window = window
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        # Per head (Qwen3), or across the heads (OLMo 2, OLMoE: the whole projection's width).
        self.qk_norm_whole = config.qk_norm_whole_width
        q_width, k_width = (
            (self.q_size, self.kv_size) if self.qk_norm_whole else (self.head_dim, self.head_dim)
        )
        self.q_norm = RMSNorm(q_width, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(k_width, config.rms_norm_eps) if config.qk_norm else None
        self.use_rope = use_rope
        self.output_multiplier = config.residual_multiplier
        self.backend = backend
        self.ops = ops

    def forward(
        self,
        rope: RopeTables,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_whole and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # [num_tokens, q_size], [num_tokens, kv_size]
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None and not self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = self.ops.rotary(q, k, rope)
        if self.window is None:
            out = self.backend.forward(q, k, v, kv_cache, metadata)
        else:
            out = self.backend.forward(q, k, v, kv_cache, metadata, window=self.window)
        return _scaled(self.o_proj(out.reshape(num_tokens, self.q_size)), self.output_multiplier)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: LayerOps) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.output_multiplier = config.residual_multiplier
        self.gelu = config.hidden_act == "gelu_tanh"
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.gate_up_proj, PackedSiluGateUp | LoraGateUp):
            # SiLU-and-mul ran in the packed GEMMs' epilogues (``packed_linear.py``), or after
            # the LoRA deltas (``lora.py``).
            out = self.down_proj(self.gate_up_proj(x))
        elif self.gelu:
            out = self.down_proj(self.ops.gelu_tanh_and_mul(self.gate_up_proj(x)))
        else:
            out = self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
        return _scaled(out, self.output_multiplier)


GROUPED_MIN_TOKENS = 4
"""Tokens from which ``SparseMoe`` runs its experts as grouped GEMMs on a CPU: below, the grouped
GEMM's cost for every expert, hit or not, outweighs the loop's per expert hit (one token with 128
experts, top 8: 0.74 ms against 0.51; 4 tokens: 1.49 against 1.61; ``benchmarks/moe_experts.py``,
docs/benchmarks.md)."""


class SparseMoe(nn.Module):
    """A mixture of SwiGLU experts in place of the MLP (Mixtral, Qwen3-MoE, Granite MoE), as
    transformers computes it: a router's softmax over the experts picks each token's top k, whose
    outputs are summed weighted by those probabilities (divided by their sum where
    ``norm_topk_prob``; Granite's softmax runs over the top k logits alone).

    The experts' weights are stacked, ``[E, 2I, H]`` (gate rows, then up) and ``[E, H, I]``
    (down), which the loader fills from the checkpoint's per-expert tensors. A step's (token,
    expert) pairs are sorted by expert; on a CPU, from ``GROUPED_MIN_TOKENS`` tokens, both
    products then run as one grouped GEMM each (``torch._grouped_mm``, the expert groups given by
    their end offsets), where a loop over the experts costs a handful of torch calls per expert
    hit: with 128 experts (Qwen3-30B-A3B's) a 64-token step hits nearly all of them in every
    layer. Below that, and on other devices (untested on a GPU, where the grouped GEMM takes bf16
    only), the loop runs each expert hit on its tokens' rows.
    """

    def __init__(self, config: ModelConfig, ops: LayerOps) -> None:
        super().__init__()
        experts, size, hidden = (
            config.num_experts,
            config.moe_intermediate_size,
            config.hidden_size,
        )
        self.num_experts, self.top_k = experts, config.num_experts_per_tok
        self.normalize = config.norm_topk_prob
        self.fp32_weights = config.routing_weights_in_fp32
        self.softmax_over_top_k = config.softmax_over_top_k
        # Plain parameters, not nn.Linear: the packing and fp8 passes leave them alone.
        self.router_weight = nn.Parameter(torch.empty(experts, hidden))  # [E, H]
        self.experts_gate_up = nn.Parameter(torch.empty(experts, 2 * size, hidden))  # [E, 2I, H]
        self.experts_down = nn.Parameter(torch.empty(experts, hidden, size))  # [E, H, I]
        self.grouped = True
        """Grouped GEMMs on a CPU from GROUPED_MIN_TOKENS tokens; False: the loop always."""
        self.gate_up_modules: nn.ModuleList | None = None
        """Each expert's gate_up as a module of its own (a GGUF file's codes on a CPU,
        ``gguf_linear.install_gguf_linears``) in place of ``experts_gate_up``, and likewise
        ``down_modules``: the loop then runs them."""
        self.down_modules: nn.ModuleList | None = None
        self.output_multiplier = config.residual_multiplier
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden] → [num_tokens, hidden]."""
        logits = nn.functional.linear(x, self.router_weight)  # [T, E]
        if self.softmax_over_top_k:  # Granite MoE
            top, chosen = torch.topk(logits.float(), self.top_k, dim=-1)  # [T, k] each
            weights = torch.softmax(top, dim=-1)
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # [T, k] each
            if self.normalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = (weights if self.fp32_weights else weights.to(x.dtype)).flatten()  # [T*k]
        # The (token, slot) pairs grouped by expert, in token order within each: [T*k].
        experts = chosen.flatten()
        pairs = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=self.num_experts)  # [E]
        tokens = pairs // self.top_k
        if (
            self.grouped
            and self.gate_up_modules is None
            and x.device.type == "cpu"
            and x.shape[0] >= GROUPED_MIN_TOKENS
        ):
            ends = torch.cumsum(counts, 0, dtype=torch.int32)
            h = torch._grouped_mm(x[tokens], self.experts_gate_up.transpose(1, 2), offs=ends)
            h = self.ops.silu_and_mul(h)  # [T*k, I]
            y = torch._grouped_mm(h, self.experts_down.transpose(1, 2), offs=ends)
            y = y * weights[pairs, None]
        else:
            y = self._expert_loop(x, tokens, counts.tolist()) * weights[pairs, None]
        # A token's pairs in ascending expert order, as transformers adds them: the same sums.
        out = torch.zeros_like(x)
        return _scaled(out.index_add_(0, tokens, y.to(out.dtype)), self.output_multiplier)

    def _expert_loop(
        self, x: torch.Tensor, tokens: torch.Tensor, counts: list[int]
    ) -> torch.Tensor:
        """The experts' outputs [T*k, H] for the pairs sorted by expert, one expert at a time."""
        outputs, start = [], 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = x[tokens[start : start + count]]
            start += count
            if self.gate_up_modules is not None and self.down_modules is not None:
                h = self.ops.silu_and_mul(self.gate_up_modules[expert](rows))
                outputs.append(self.down_modules[expert](h))
                continue
            h = self.ops.silu_and_mul(nn.functional.linear(rows, self.experts_gate_up[expert]))
            outputs.append(nn.functional.linear(h, self.experts_down[expert]))
        return torch.cat(outputs)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        ops: LayerOps,
        *,
        use_rope: bool,
        moe: bool = False,
        window: int | None = None,
    ):
        super().__init__()
        self.self_attn = Attention(config, backend, ops, use_rope=use_rope, window=window)
        self.sliding = window is not None
        """It takes the sliding layers' RoPE table (``LlamaModel.local_rotary``)."""
        self.mlp: MLP | SparseMoe = SparseMoe(config, ops) if moe else MLP(config, ops)
        self.post_norms = config.post_norms
        # Before attention and the MLP (Llama), or after each (OLMo 2: the same name for the
        # one after attention, and no input_layernorm).
        if not self.post_norms:
            self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.post_norms or config.sandwich_norms:
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sandwich_norms = config.sandwich_norms
        if self.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ops = ops

    def forward(
        self,
        rope: RopeTables,
        hidden: torch.Tensor,
        pending: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """hidden: [num_tokens, hidden_size], the residual stream, updated in place; pending:
        the previous layer's MLP output not yet added to it (None before the first layer).
        Returns this layer's MLP output, pending in turn (``layer_ops``' residual stream)."""
        if self.post_norms:
            if pending is not None:
                hidden.add_(pending)
            attn = self.self_attn(rope, hidden, kv_cache, metadata)
            norm = self.post_attention_layernorm
            hidden.add_(self.ops.rms_norm(attn, None, norm.weight, norm.eps))
            norm = self.post_feedforward_layernorm
            return self.ops.rms_norm(self.mlp(hidden), None, norm.weight, norm.eps)
        norm = self.input_layernorm
        normed = self.ops.rms_norm(hidden, pending, norm.weight, norm.eps)
        attn = self.self_attn(rope, normed, kv_cache, metadata)
        norm = self.post_attention_layernorm
        if self.sandwich_norms:  # Gemma 3: attention's output normed, then added, then normed
            attn = self.ops.rms_norm(attn, None, norm.weight, norm.eps)
            norm = self.pre_feedforward_layernorm
            out = self.mlp(self.ops.rms_norm(hidden, attn, norm.weight, norm.eps))
            norm = self.post_feedforward_layernorm
            return self.ops.rms_norm(out, None, norm.weight, norm.eps)
        return self.mlp(self.ops.rms_norm(hidden, attn, norm.weight, norm.eps))


class LlamaModel(nn.Module):
    def __init__(
        self, config: ModelConfig, max_positions: int, backend: AttentionBackend, ops: LayerOps
    ):
        super().__init__()
        # Gemma 2's soft-capped scores: every layer's, so the backend the layers share is told.
        backend.softcap = config.attn_logit_softcapping
        # One rotary table shared by every layer (Gemma 3: a second for its sliding layers).
        self.rotary = RotaryEmbedding(
            config.head_dim, max_positions, config.rope_theta, config.rope_scaling
        )
        self.local_rotary = (
            RotaryEmbedding(config.head_dim, max_positions, config.local_rope_theta, None)
            if config.local_rope_theta is not None
            else None
        )
        # The weight is given, so nn.Embedding skips its normal_() initialisation: the loader
        # builds the model on the meta device, where normal_() goes through torch._refs and
        # imports torch._dynamo (1-1.4 s of every node's start-up on a 2-core host); the
        # checkpoint overwrites the values anyway.
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(
            DecoderLayer(
                config,
                backend,
                ops,
                use_rope=i not in config.nope_layers,
                moe=i in config.moe_layers,
                window=config.local_window if i in config.sliding_layers else None,
            )
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        backend: AttentionBackend,
        ops: LayerOps | None = None,
    ):
        """``ops``: the elementwise steps' implementation (default: torch's)."""
        super().__init__()
        self.config = config
        self.ops = ops or _TORCH_OPS
        self.model = LlamaModel(config, max_positions, backend, self.ops)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.can_generate = True
        """False for a checkpoint without an lm_head (an embedding model's): it only embeds."""
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
        multiplier = self.config.embedding_multiplier
        if self.config.embedding_multiplier_in_dtype:
            # The compute dtype (the embedding's, unless it holds a GGUF file's codes).
            multiplier = float(torch.tensor(multiplier, dtype=self.model.norm.weight.dtype))
        hidden = _scaled(self.model.embed_tokens(input_ids), multiplier)
        rope = self.model.rotary.tables(positions, hidden.dtype)
        local = self.model.local_rotary
        local_rope = local.tables(positions, hidden.dtype) if local is not None else rope
        pending = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            layer_rope = local_rope if layer.sliding else rope
            pending = layer(layer_rope, hidden, pending, kv_cache, metadata)
        if pending is not None:
            hidden.add_(pending)
        return hidden

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_rows, hidden_size] → the same rows after the final norm (what
        ``compute_logits`` projects; Hugging Face's ``last_hidden_state``)."""
        norm = self.model.norm
        return self.ops.rms_norm(hidden, None, norm.weight, norm.eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_rows, hidden_size] → logits [num_rows, vocab_size] in the model's dtype
        (the sampler computes on a float32 copy; widening here first would copy them twice)."""
        norm = self.model.norm
        logits = self.lm_head(self.ops.rms_norm(hidden, None, norm.weight, norm.eps))
        cap = self.config.final_logit_softcapping
        if cap is not None:  # Gemma 2: as transformers computes it, in the logits' dtype
            logits = torch.tanh(logits / cap) * cap
        return _scaled(logits, 1.0 / self.config.logits_scaling)

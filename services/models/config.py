"""The shape of a Llama-family checkpoint, read from its Hugging Face ``config.json`` or from a
GGUF file's metadata (``gguf_file`` translates it to the same keys).

The family: Llama and Mistral; Qwen2 (Q/K/V biases); Qwen3 (RMSNorm over each head of Q and K);
SmolLM3 (some layers without RoPE: ``no_rope_layers``); Granite 3 (four scalar multipliers on the
embeddings, the attention scores, each residual branch and the logits); Phi-3 and Phi-4 (their
checkpoints hold Q/K/V and gate/up already fused); Mixtral, Qwen3-MoE, Granite 3 MoE and OLMoE (a
mixture of SwiGLU experts in place of the MLP, a router choosing each token's top k; OLMoE's Q and K
normalized across all heads); OLMo 2 (norms after
attention and the MLP instead of before, Q and K normalized across all heads); Gemma 3 (text:
GELU-gated MLP, four norms a layer scaling by 1 + weight, embeddings scaled by sqrt(hidden), and
five sliding-window layers with their own RoPE base for every global one); Gemma 2 (Gemma 3's
layer without Q/K norms, every other layer sliding, soft-capped attention scores and logits)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.models.gguf_file import GGUF_ROPE_FREQS, find_gguf, open_gguf
from services.models.model_file_error import ModelFileError, read_json_object
from services.types import EngineConfigError

logger = logging.getLogger(__name__)

_REQUIRED_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
    "vocab_size",
)
"""``config.json`` keys every supported architecture sizes its weights by: without one, loading
failed with a bare ``KeyError`` (a traceback, no file named)."""

# Hugging Face ``architectures`` entries we implement, and the model_type each implies.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "SmolLM3ForCausalLM": "smollm3",
    "GraniteForCausalLM": "granite",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Olmo2ForCausalLM": "olmo2",
    "Gemma3ForCausalLM": "gemma3_text",
    "GraniteMoeForCausalLM": "granitemoe",
    "OlmoeForCausalLM": "olmoe",
    "Gemma2ForCausalLM": "gemma2",
}
# What transformers' Gemma3TextConfig assumes for a key that a Gemma 3 multimodal checkpoint's
# ``text_config`` leaves out (google/gemma-3-4b-it's names only its sizes and rope scaling).
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10000.0,
    "bos_token_id": 2,
    "eos_token_id": 1,
}
MULTIMODAL_GEMMA3 = "Gemma3ForConditionalGeneration"
"""Gemma 3 from 4B up: a vision tower beside the language model. Its language model is served
(text in, text out); its weights sit under ``language_model.``, the vision tower's are skipped."""


def text_model_config(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` itself, or for a multimodal Gemma 3 checkpoint its language model's config as a
    ``Gemma3ForCausalLM`` one: ``text_config`` over transformers' defaults, with the top level's
    embedding tie and token ids."""
    if MULTIMODAL_GEMMA3 not in (raw.get("architectures") or []):
        return raw
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise EngineConfigError(f"config.json of a {MULTIMODAL_GEMMA3} has no text_config object")
    ids = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in raw}
    merged = {**_GEMMA3_TEXT_DEFAULTS, **ids, **text, "architectures": ["Gemma3ForCausalLM"]}
    merged["tie_word_embeddings"] = raw.get("tie_word_embeddings", True)
    return merged


# Architectures whose ``sliding_window`` only applies with ``use_sliding_window: true``.
_OPT_IN_SLIDING_WINDOW = ("qwen2", "qwen3", "smollm3", "qwen3_moe")
# Granite's multipliers (``config.json`` keys; ModelConfig says what each scales), 1 elsewhere.
_GRANITE_MULTIPLIERS = (
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
)
_SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation (``rope_type: linear``): every frequency divided by ``factor``
    (Gemma 3's global layers from 4B up: 8)."""

    factor: float


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class RopeFrequencyFactors:
    """One divisor per rotary frequency (``[head_dim // 2]``): llama.cpp's ``rope_freqs``
    tensor, which its converter computes from Llama 3.1's ``rope_scaling`` (1 for the short
    wavelengths, ``factor`` for the long ones, interpolated between)."""

    factors: tuple[float, ...]


AnyRopeScaling = RopeScaling | LinearRopeScaling | RopeFrequencyFactors


def with_overrides(raw: dict[str, Any], overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """``raw`` (a model's ``config.json``) with ``overrides`` (vLLM's ``hf_overrides``) in
    place of its values, a nested object merged key by key (``{"rope_scaling": {"factor":
    4}}`` keeps the rest of ``rope_scaling``), as vLLM applies them."""
    merged = dict(raw)
    for key, value in (overrides or {}).items():
        current = merged.get(key)
        if isinstance(value, Mapping) and isinstance(current, dict):
            merged[key] = with_overrides(current, value)
        else:
            merged[key] = value
    return merged


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: AnyRopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    """Q/K/V projections carry a bias (Qwen2)."""
    qk_norm: bool
    """RMSNorm over each head of Q and K before RoPE (Qwen3); over all of Q's heads at once and
    all of K's where ``post_norms`` (OLMo 2)."""
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    hidden_act: str = "silu"
    """The MLP's gate activation: ``silu`` (SwiGLU), or ``gelu_tanh`` (Gemma's GeGLU,
    transformers' ``gelu_pytorch_tanh``)."""
    sandwich_norms: bool = False
    """Gemma 3: attention's and the MLP's outputs are normalized too (``post_attention_layernorm``
    on attention's output, ``pre_feedforward_layernorm`` before the MLP,
    ``post_feedforward_layernorm`` after it)."""
    norm_weight_offset: float = 0.0
    """Gemma's RMSNorm scales by 1 + weight: the loader adds this to every norm weight it reads."""
    sliding_layers: frozenset[int] = frozenset()
    """Gemma 3: layers that attend to their last ``local_window`` tokens only (the others, and
    every layer of the other architectures, to the whole context)."""
    local_window: int | None = None
    local_rope_theta: float | None = None
    """Gemma 3: the RoPE base of the sliding-window layers (the others take ``rope_theta``)."""
    weight_prefix: str = ""
    """What the checkpoint's names of our weights start with before ``model.`` / ``lm_head``
    (a multimodal Gemma 3's ``language_model.``)."""
    skipped_weight_prefixes: tuple[str, ...] = ()
    """Checkpoint weights that are not the language model's (a multimodal Gemma 3's vision
    tower and projector), skipped by the loader; any other stray weight is still an error."""
    post_norms: bool = False
    """OLMo 2: attention and the MLP take the residual stream as it is, and their outputs are
    normalized (``post_attention_layernorm``, ``post_feedforward_layernorm``) before each is
    added to it; no ``input_layernorm``."""
    qk_norm_whole_width: bool = False
    """OLMo 2 and OLMoE: ``q_norm`` and ``k_norm`` span the whole projection (every head at
    once), not one head (Qwen3, Gemma 3)."""
    fused_checkpoint: bool = False
    """The checkpoint holds each layer's ``qkv_proj`` and ``gate_up_proj`` fused, in our
    layout (Phi-3), rather than q/k/v and gate/up apart."""
    nope_layers: frozenset[int] = frozenset()
    """Layers that apply no rotary embedding to Q and K (SmolLM3: the zeros of its
    ``no_rope_layers``, every fourth layer)."""
    embedding_multiplier: float = 1.0
    """Granite: the input embeddings are multiplied by it (Gemma 3: by sqrt(hidden_size))."""
    embedding_multiplier_in_dtype: bool = False
    """Gemma: the multiplier is rounded to the compute dtype first (in bf16, sqrt(640) is 25.25),
    as transformers rounds it."""
    residual_multiplier: float = 1.0
    """Granite: each attention and MLP output is multiplied by it before the residual add."""
    attention_multiplier: float | None = None
    """Granite: the attention scores' scale, in place of 1 / sqrt(head_dim)."""
    attn_logit_softcapping: float | None = None
    """Gemma 2: each attention score ``s`` becomes ``cap * tanh(s / cap)`` before the softmax
    (after the scale), on the torch attention path."""
    final_logit_softcapping: float | None = None
    """Gemma 2: the logits likewise, after the lm_head."""
    logits_scaling: float = 1.0
    """Granite: the logits are divided by it."""
    num_experts: int = 0
    """Mixture-of-experts models: experts per MoE layer (0: none)."""
    num_experts_per_tok: int = 0
    """The experts the router picks for each token (top k)."""
    moe_intermediate_size: int = 0
    """An expert's intermediate size (Mixtral's is ``intermediate_size``)."""
    norm_topk_prob: bool = True
    """The top k routing probabilities are divided by their sum (Mixtral always; Qwen3-MoE as
    its ``norm_topk_prob`` says)."""
    softmax_over_top_k: bool = False
    """Granite MoE: the softmax runs over the top k logits only (the same weights as normalizing
    the top k of a softmax over all, rounded otherwise)."""
    routing_weights_in_fp32: bool = False
    """Mixtral multiplies each expert's output by its fp32 routing weight; Qwen3-MoE rounds the
    weights to the compute dtype first."""
    moe_layers: frozenset[int] = frozenset()
    """The layers whose MLP is a mixture of experts (Qwen3-MoE may keep some dense:
    ``mlp_only_layers``, ``decoder_sparse_step``)."""
    matryoshka_dimensions: tuple[int, ...] | None = None
    """Embedding sizes the model was trained to be cut to (Matryoshka representation learning),
    from ``config.json``'s ``matryoshka_dimensions``; ``()`` where ``is_matryoshka`` allows any
    size; None where it declares neither, so its embeddings keep every value (as vLLM reads
    both keys)."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise EngineConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def attention_scale(self) -> float:
        """What q . k is multiplied by before the softmax."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return 1.0 / math.sqrt(self.head_dim)

    @classmethod
    def from_model_path(
        cls, path: Path | str, overrides: Mapping[str, Any] | None = None
    ) -> ModelConfig:
        """From a Hugging Face model directory, a GGUF file, or a directory holding one;
        ``overrides`` (vLLM's ``hf_overrides``) replace its config's values first."""
        gguf_path = find_gguf(path)
        if gguf_path is None:
            return cls.from_model_dir(path, overrides)
        gguf = open_gguf(gguf_path)
        return cls.from_hf_dict(
            with_overrides(gguf.hf_config(), overrides), gguf.generation_config()
        )

    @classmethod
    def from_model_dir(
        cls, model_dir: Path | str, overrides: Mapping[str, Any] | None = None
    ) -> ModelConfig:
        model_dir = Path(model_dir)
        expected = "a Hugging Face model directory, a GGUF file, or a directory holding one"
        if not model_dir.exists():
            raise FileNotFoundError(f"{model_dir} does not exist: expected {expected}")
        if not model_dir.is_dir():
            raise FileNotFoundError(
                f"{model_dir} is a file, but not a GGUF file (*.gguf): expected {expected}"
            )
        path = model_dir / "config.json"
        if not path.is_file():
            if not any(model_dir.iterdir()):
                raise FileNotFoundError(f"{model_dir} is an empty directory: expected {expected}")
            raise FileNotFoundError(
                f"{model_dir} has no config.json and no GGUF file: expected {expected}"
            )
        raw = with_overrides(read_json_object(path), overrides)
        text = text_model_config(raw)
        for key in _REQUIRED_SIZES:
            value = text.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problem = "has no" if key not in text else f"has {value!r} for"
                raise ModelFileError(path, f"{problem} {key!r}: expected a positive integer")
        generation_path = model_dir / "generation_config.json"
        generation = read_json_object(generation_path) if generation_path.is_file() else {}
        return cls.from_hf_dict(raw, generation)

    @classmethod
    def from_hf_dict(
        cls, raw: dict[str, Any], generation: dict[str, Any] | None = None
    ) -> ModelConfig:
        multimodal = MULTIMODAL_GEMMA3 in (raw.get("architectures") or [])
        raw = text_model_config(raw)
        architecture = _architecture(raw)
        model_type = SUPPORTED_ARCHITECTURES[architecture]
        hidden_size = raw["hidden_size"]
        num_heads = raw["num_attention_heads"]
        rope_theta, rope_scaling = _rope(raw)
        # Qwen2 declares a sliding window that is off unless use_sliding_window is set.
        sliding_window = raw.get("sliding_window")
        if model_type in _OPT_IN_SLIDING_WINDOW and not raw.get("use_sliding_window", False):
            sliding_window = None
        if model_type in _GEMMA:  # per layer, attended as such: local_window
            sliding_window = None
        num_layers = raw["num_hidden_layers"]
        eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=architecture,
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden_size,
            intermediate_size=raw["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden_size // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get(
                "tie_word_embeddings", model_type in ("qwen2", "smollm3", *_GEMMA)
            ),
            attention_bias=raw.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "olmo2", "gemma3_text", "olmoe"),
            post_norms=model_type == "olmo2",
            qk_norm_whole_width=model_type in ("olmo2", "olmoe"),
            weight_prefix="language_model." if multimodal else "",
            skipped_weight_prefixes=("vision_tower.", "multi_modal_projector.")
            if multimodal
            else (),
            sliding_window=sliding_window,
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            matryoshka_dimensions=_matryoshka(raw),
            fused_checkpoint=model_type == "phi3",
            nope_layers=_nope_layers(raw, num_layers) if model_type == "smollm3" else frozenset(),
            **(_granite_multipliers(raw) if model_type in ("granite", "granitemoe") else {}),
            **(_experts(raw, model_type, num_layers) if model_type in _MOE else {}),
            **(_gemma3(raw, num_layers, hidden_size) if model_type == "gemma3_text" else {}),
            **(_gemma2(raw, num_layers, hidden_size) if model_type == "gemma2" else {}),
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


_MOE = ("mixtral", "qwen3_moe", "granitemoe", "olmoe")
_GEMMA = ("gemma2", "gemma3_text")


def _gemma_layers(raw: dict[str, Any], types: list[str] | None, hidden_size: int) -> dict[str, Any]:
    """What Gemma 2 and Gemma 3 read alike: the GELU-gated MLP, the four norms scaling by 1 +
    weight, embeddings times sqrt(hidden), the attention scale ``query_pre_attn_scalar **
    -0.5``, and which layers slide (``types``: ``layer_types``, or each family's default) over
    how many tokens."""
    num_layers = raw["num_hidden_layers"]
    activation = raw.get("hidden_activation", raw.get("hidden_act", "gelu_pytorch_tanh"))
    if activation != "gelu_pytorch_tanh":
        raise EngineConfigError(
            f"config.json's hidden_activation {activation!r}: only gelu_pytorch_tanh is built"
        )
    window = _positive_int(raw, "sliding_window")
    if (
        not isinstance(types, list)
        or len(types) != num_layers
        or any(t not in ("sliding_attention", "full_attention") for t in types)
    ):
        raise EngineConfigError(
            f"config.json's layer_types must list {num_layers} of 'sliding_attention' and "
            f"'full_attention', got {types!r}"
        )
    scalar = raw.get("query_pre_attn_scalar", 256)
    if isinstance(scalar, bool) or not isinstance(scalar, int | float) or not scalar > 0:
        raise EngineConfigError(
            f"config.json's query_pre_attn_scalar must be a positive number, got {scalar!r}"
        )
    return {
        "hidden_act": "gelu_tanh",
        "sandwich_norms": True,
        "norm_weight_offset": 1.0,
        "sliding_layers": frozenset(i for i, t in enumerate(types) if t == "sliding_attention"),
        "local_window": window,
        "embedding_multiplier": hidden_size**0.5,
        "embedding_multiplier_in_dtype": True,
        "attention_multiplier": float(scalar) ** -0.5,
    }


def _gemma2(raw: dict[str, Any], num_layers: int, hidden_size: int) -> dict[str, Any]:
    """Gemma 2 as transformers reads it: Gemma 3's layer without Q/K norms, every other layer
    sliding (``layer_types``, or the even ones), one RoPE base for all, and soft-capped
    attention scores and logits."""
    types = raw.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
    ]
    caps = {}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = raw.get(key)
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int | float)
                                or not math.isfinite(cap) or cap <= 0):  # fmt: skip
            raise EngineConfigError(f"config.json's {key} must be a positive number, got {cap!r}")
        caps[key] = None if cap is None else float(cap)
    return {**_gemma_layers(raw, types, hidden_size), **caps}


def _gemma3(raw: dict[str, Any], num_layers: int, hidden_size: int) -> dict[str, Any]:
    """Gemma 3's text model as transformers reads it: its layer types (``layer_types``, or every
    ``sliding_window_pattern``-th layer global, the rest sliding), the two RoPE bases (transformers
    5's ``rope_parameters`` per layer type, or ``rope_theta`` and ``rope_local_base_freq``); no
    logit soft-capping (Gemma 2's)."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(key) is not None:
            raise EngineConfigError(f"config.json's {key} (logit soft-capping) is not supported")
    if raw.get("use_bidirectional_attention"):
        raise EngineConfigError("config.json's use_bidirectional_attention is not supported")
    types = raw.get("layer_types")
    if types is None:
        pattern = _positive_int(raw, "sliding_window_pattern", 6)
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
    layers = _gemma_layers(raw, types, hidden_size)
    params = raw.get("rope_parameters") or {}
    if "sliding_attention" in params:
        local = params["sliding_attention"]
        if local.get("rope_type", "default") != "default":
            raise EngineConfigError(
                f"unsupported rope_type {local.get('rope_type')!r} of the sliding-window layers"
            )
        local_theta = float(local.get("rope_theta", 10000.0))
    else:
        local_theta = float(raw.get("rope_local_base_freq", 10000.0))
    return {**layers, "local_rope_theta": local_theta}


def _positive_int(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    """``raw[key]`` (``default`` where absent, if given), refused naming the key unless it is
    a positive integer."""
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EngineConfigError(f"config.json's {key} must be a positive integer, got {value!r}")
    return value


def _experts(raw: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """A mixture-of-experts model's experts, as transformers reads them: Mixtral's
    ``num_local_experts`` of ``intermediate_size`` in every layer; OLMoE's ``num_experts`` of
    ``intermediate_size`` in every layer; Qwen3-MoE's ``num_experts``
    of ``moe_intermediate_size`` in every ``decoder_sparse_step``-th layer not in
    ``mlp_only_layers``."""
    top_k = _positive_int(raw, "num_experts_per_tok")
    if model_type in ("mixtral", "granitemoe"):
        num_experts = _positive_int(raw, "num_local_experts")
        size, normalize, layers = raw["intermediate_size"], True, set(range(num_layers))
    elif model_type == "olmoe":  # experts of intermediate_size in every layer
        if raw.get("clip_qkv") is not None:
            raise EngineConfigError("config.json's clip_qkv (clamped Q, K, V) is not supported")
        key = "num_experts" if "num_experts" in raw else "num_local_experts"
        num_experts = _positive_int(raw, key)
        size, layers = raw["intermediate_size"], set(range(num_layers))
        normalize = bool(raw.get("norm_topk_prob", False))
    else:
        # Qwen's checkpoints say num_experts; transformers 5 writes num_local_experts.
        key = "num_experts" if "num_experts" in raw else "num_local_experts"
        num_experts = _positive_int(raw, key)
        size = _positive_int(raw, "moe_intermediate_size")
        normalize = bool(raw.get("norm_topk_prob", False))
        step = _positive_int(raw, "decoder_sparse_step", 1)
        dense = raw.get("mlp_only_layers") or []
        if not isinstance(dense, list):
            raise EngineConfigError(f"config.json's mlp_only_layers must be a list, got {dense!r}")
        layers = {i for i in range(num_layers) if i not in dense and (i + 1) % step == 0}
    if top_k > num_experts:
        raise EngineConfigError(
            f"config.json's num_experts_per_tok ({top_k}) exceeds its {num_experts} experts"
        )
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": size,
        "norm_topk_prob": normalize,
        "routing_weights_in_fp32": model_type == "mixtral",
        "softmax_over_top_k": model_type == "granitemoe",
        "moe_layers": frozenset(layers),
    }


def _nope_layers(raw: dict[str, Any], num_layers: int) -> frozenset[int]:
    """SmolLM3's layers without RoPE: ``no_rope_layers`` holds 1 for a layer that applies it
    and 0 for one that does not, one entry a layer; absent, transformers' default, every
    ``no_rope_layer_interval``-th layer (4) goes without."""
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = _positive_int(raw, "no_rope_layer_interval", 4)
        return frozenset(i for i in range(num_layers) if (i + 1) % interval == 0)
    if (
        not isinstance(flags, list)
        or len(flags) != num_layers
        or any(flag not in (0, 1) or isinstance(flag, float) for flag in flags)
    ):
        raise EngineConfigError(
            f"config.json's no_rope_layers must be a list of {num_layers} values, each 0 or 1 "
            f"(one per layer), got {flags!r}"
        )
    return frozenset(i for i, flag in enumerate(flags) if flag == 0)


def _granite_multipliers(raw: dict[str, Any]) -> dict[str, float]:
    """Granite's four multipliers (transformers' defaults: 1), each a positive number."""
    values: dict[str, float] = {}
    for key in _GRANITE_MULTIPLIERS:
        value = raw.get(key, 1.0)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not 0 < value < math.inf:
            raise EngineConfigError(f"config.json's {key} must be a positive number, got {value!r}")
        values[key] = float(value)
    return values


def _matryoshka(raw: dict[str, Any]) -> tuple[int, ...] | None:
    dimensions = raw.get("matryoshka_dimensions")
    if dimensions:
        if not isinstance(dimensions, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dimensions
        ):
            raise EngineConfigError(
                f"config.json's matryoshka_dimensions must be a list of positive integers, got "
                f"{dimensions!r}"
            )
        return tuple(dimensions)
    return () if raw.get("is_matryoshka") is True else None


def _architecture(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    found = ", ".join(architectures) or f"model_type={raw.get('model_type')!r}"
    raise EngineConfigError(f"unsupported architecture {found}; pdserve supports {supported}")


def _rope(raw: dict[str, Any]) -> tuple[float, AnyRopeScaling | None]:
    # transformers 5 writes ``rope_parameters`` (theta inside; Gemma 3's per layer type, the
    # global layers' here); older checkpoints write ``rope_theta`` and ``rope_scaling`` (with
    # ``type`` or ``rope_type``).
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if "full_attention" in params:
        params = params["full_attention"]
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == GGUF_ROPE_FREQS:
        return theta, _frequency_factors(params.get("factors"), raw)
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise EngineConfigError(
            f"unsupported rope_type {rope_type!r}; "
            f"pdserve supports {', '.join(_SUPPORTED_ROPE_TYPES)}"
        )
    # Rotary over the first part of each head only (Phi-4-mini's 0.75, with longrope).
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise EngineConfigError(
            f"partial_rotary_factor {partial!r} (rotary over part of each head) is not supported"
        )
    if rope_type == "default":
        return theta, None
    factor = params.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not factor > 0:
        raise EngineConfigError(f"rope scaling's factor must be a positive number, got {factor!r}")
    if rope_type == "linear":
        return theta, LinearRopeScaling(float(factor))
    return theta, RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _frequency_factors(value: Any, raw: dict[str, Any]) -> RopeFrequencyFactors:
    """A GGUF file's ``rope_freqs``: one positive finite divisor per frequency of a head."""
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    if (
        not isinstance(value, list)
        or len(value) != head_dim // 2
        or not all(isinstance(f, int | float) and math.isfinite(f) and f > 0 for f in value)
    ):
        raise EngineConfigError(
            f"rope_freqs must hold {head_dim // 2} positive finite factors (one per frequency "
            f"of a {head_dim}-wide head), got {value!r}"
        )
    return RopeFrequencyFactors(tuple(float(f) for f in value))

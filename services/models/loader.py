"""Loads a checkpoint into ``LlamaForCausalLM``: Hugging Face safetensors (one file, or shards
with an index), or a GGUF file (``gguf_loader`` names and dequantizes its tensors). An fp8
checkpoint's weights (``fp8_checkpoint``) are joined with their scales and either kept in fp8
(the projections that ``fp8_linears`` made ``Fp8Linear``) or dequantized; a 16-bit weight bound
for an ``Fp8Linear`` is quantized per row on the way in (``--quantization fp8``).

The checkpoint's separate q/k/v and gate/up projections are copied into our fused parameters (a
Phi-3 checkpoint's, fused already, whole);
every parameter must be filled exactly once, and a missing, unexpected or misshapen weight is a
``ModelFileError`` that names it and its file.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from services.host_memory import advise_huge_pages
from services.models.attention import AttentionBackend
from services.models.config import ModelConfig
from services.models.fp8_checkpoint import (
    Fp8Weights,
    QuantizedWeight,
    quantize_rows,
    read_fp8_checkpoint,
)
from services.models.fp8_linear import Fp8Linear, install_fp8_linears
from services.models.gguf_blocks import GgufBlocks
from services.models.gguf_file import find_gguf, open_gguf
from services.models.gguf_linear import (
    GgufLinear,
    gguf_codes_unavailable_reason,
    install_gguf_linears,
)
from services.models.gguf_loader import gguf_weights
from services.models.layer_ops import LayerOps
from services.models.llama import LlamaForCausalLM
from services.models.model_file_error import ModelFileError

logger = logging.getLogger(__name__)

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# Checkpoint entries that hold no weights of ours (recomputed buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_bytes())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise ModelFileError(index, f"not a safetensors index ({exc!r})") from None
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {index} are missing: {', '.join(missing)}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {model_dir} "
        "(pdserve loads safetensors checkpoints only)"
    )


def load_model(
    model_dir: Path,
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    backend: AttentionBackend,
    ops: LayerOps | None = None,
    fp8_linears: bool = False,
) -> LlamaForCausalLM:
    """``ops``: the decoder's elementwise steps (default: torch's; ``layer_ops.py``).
    ``fp8_linears``: the decoder's projections hold fp8 weights and multiply in fp8
    (``fp8_linear.py``), but for those an fp8 checkpoint leaves in 16 bits."""
    gguf_path = find_gguf(model_dir)
    scheme = None if gguf_path is not None else read_fp8_checkpoint(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions, backend, ops).to(dtype)
    if fp8_linears:
        count = install_fp8_linears(model, scheme, device)
        logger.info("%d decoder projections hold fp8 weights", count)
    gguf = open_gguf(gguf_path) if gguf_path is not None else None
    code_names: frozenset[str] = frozenset()
    # Our parameter names whose modules hold codes (gguf_linear.GgufCodes.modules).
    gguf_modules: dict[str, GgufLinear] = {}
    if gguf is not None and gguf.is_quantized:
        unavailable = gguf_codes_unavailable_reason(device)
        if unavailable is None:
            installed = install_gguf_linears(model, gguf)
            code_names, gguf_modules = installed.weight_names, installed.modules
            logger.info(
                "%s: %d weights keep their quantized blocks as int8 codes",
                gguf_path,
                len(gguf_modules),
            )
        else:
            logger.info("%s: every weight dequantized to %s (%s)", gguf_path, dtype, unavailable)
    model = model.to_empty(device=device)
    if device.type == "cpu":
        for param in model.parameters():
            advise_huge_pages(param.data_ptr(), param.nbytes)
    if config.tie_word_embeddings and not isinstance(model.lm_head, GgufLinear):
        model.lm_head.weight = model.model.embed_tokens.weight  # to_empty unties them
    model.model.rotary.to_device(device)
    if model.model.local_rotary is not None:
        model.model.local_rotary.to_device(device)

    params = dict(model.named_parameters())
    fp8_modules = {
        f"{name}.weight": module
        for name, module in model.named_modules()
        if isinstance(module, Fp8Linear)
    }
    targets = _checkpoint_targets(config)
    part_rows = _part_rows(
        targets,
        lambda name: (
            gguf_modules[name].out_features
            if name in gguf_modules
            else _parameter(params, name).shape[0]
        ),
    )
    filled: set[str] = set()
    joiner = Fp8Weights(scheme) if scheme is not None else None
    if gguf is not None:
        weights = _named(gguf_weights(gguf, config, code_names), gguf.path)
    elif joiner is not None:
        logger.info("%s: %s", model_dir, scheme.describe())  # type: ignore[union-attr]
        weights = _joined(_safetensors_weights(model_dir), joiner)
    else:
        weights = _safetensors_weights(model_dir)
    for name, tensor, origin in weights:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name.startswith(config.skipped_weight_prefixes):  # a vision tower's
            continue
        name = name.removeprefix(config.weight_prefix)  # a multimodal checkpoint's language model
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # some tied checkpoints store the shared matrix twice
        if name not in targets and f"model.{name}" in targets:
            # A checkpoint of the bare decoder (Hugging Face's LlamaModel / Qwen3Model), as
            # embedding models are saved (Qwen3-Embedding): its names lack the "model." prefix.
            name = f"model.{name}"
        if name not in targets:
            raise ModelFileError(origin, f"unexpected weight {name!r}")
        param_name, offset = targets[name]
        if isinstance(tensor, GgufBlocks):  # only a GgufLinear's weights come as codes
            module = gguf_modules[param_name]
            _check_shape(tensor.shape, (part_rows[name], module.in_features), name, origin)
            module.fill(offset, tensor)
            filled.add(name)
            continue
        if isinstance(tensor, torch.Tensor) and tensor.dtype in _FP8_DTYPES:
            # Copied as it is, an fp8 value would lose its scale and the model its weights.
            raise ModelFileError(
                origin,
                f"weight {name!r} is {tensor.dtype} without a scale: config.json's "
                "quantization_config names no fp8 scheme to read it with",
            )
        fp8_module = fp8_modules.get(param_name)
        if fp8_module is not None and not isinstance(tensor, QuantizedWeight):
            tensor = quantize_rows(tensor)
        elif fp8_module is None and isinstance(tensor, QuantizedWeight):
            tensor = tensor.dequantize()
        shape = tensor.values.shape if isinstance(tensor, QuantizedWeight) else tensor.shape
        rows = _parameter(params, param_name).narrow(0, offset, part_rows[name])
        _check_shape(shape, rows.shape, name, origin)
        if isinstance(tensor, QuantizedWeight):
            fp8_module.fill(offset, tensor)  # type: ignore[union-attr]
        else:
            rows.copy_(tensor)
        filled.add(name)
    if joiner is not None and joiner.dropped:
        logger.info(
            "%s: %d fp8 KV cache scales left unused (the KV cache holds the compute dtype)",
            model_dir,
            joiner.dropped,
        )
    if joiner is not None and joiner.leftovers():
        raise ModelFileError(
            model_dir,
            "fp8 tensors without their pair (a weight without its scale, or a scale "
            f"without its weight): {', '.join(joiner.leftovers()[:5])}",
        )
    missing = sorted(set(targets) - filled)
    if missing == ["lm_head.weight"] and "model.embed_tokens.weight" in filled:
        # No output projection (an embedding model's checkpoint): it embeds, it cannot generate.
        logger.info("%s has no lm_head: this model serves embeddings only", model_dir)
        model.can_generate = False
        missing = []
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ModelFileError(model_dir, f"the checkpoint is missing weight(s): {shown}")
    for module in set(gguf_modules.values()):  # a tied table is the lm_head's
        module.pack()
    if config.norm_weight_offset:
        # Gemma's RMSNorm scales by 1 + weight: the offset goes into the weights once.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.data.add_(config.norm_weight_offset)
    return model.eval()


def _check_shape(shape: Sequence[int], expected: Sequence[int], name: str, origin: Path) -> None:
    """A ``ModelFileError`` naming the checkpoint's weight ``name`` unless its shape is the one
    the model's config gives it."""
    if tuple(shape) != tuple(expected):
        raise ModelFileError(
            origin,
            f"weight {name!r} has shape {tuple(shape)}, "
            f"expected {tuple(expected)} from the model's config",
        )


def _part_rows(
    targets: dict[str, tuple[str, int]], rows_of: Callable[[str], int]
) -> dict[str, int]:
    """Checkpoint weight name → the rows it fills: up to the next weight's first row in the same
    parameter of ours, or to the parameter's end (``rows_of``), so that a weight of too few rows
    is an error rather than rows left as they were allocated."""
    firsts: dict[str, list[tuple[int, str]]] = {}
    for name, (param, first) in targets.items():
        firsts.setdefault(param, []).append((first, name))
    rows: dict[str, int] = {}
    for param, parts in firsts.items():
        parts.sort()
        ends = [first for first, _ in parts[1:]] + [rows_of(param)]
        for (first, name), end in zip(parts, ends, strict=True):
            rows[name] = end - first
    return rows


def _safetensors_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor, Path]]:
    for path in safetensors_files(model_dir):
        # SafetensorError names no file ("header too large"): a corrupt or truncated shard.
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, f.get_tensor(name), path
        except SafetensorError as exc:
            raise ModelFileError(path, f"not a valid safetensors file ({exc})") from None


def _joined(
    weights: Iterator[tuple[str, torch.Tensor, Path]], joiner: Fp8Weights
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight, Path]]:
    for name, tensor, origin in weights:
        yield from joiner.push(name, tensor, origin)


def _named(
    weights: Iterator[tuple[str, torch.Tensor | GgufBlocks]], origin: Path
) -> Iterator[tuple[str, torch.Tensor | GgufBlocks, Path]]:
    for name, tensor in weights:
        yield name, tensor, origin


def _parameter(params: dict[str, nn.Parameter], name: str) -> torch.Tensor:
    """The parameter ``name``, or, for ``NAME.E``, expert E's matrix of a stacked ``[experts,
    rows, columns]`` parameter (``SparseMoe``'s)."""
    if name in params:
        return params[name].data
    stacked, _, index = name.rpartition(".")
    return params[stacked].data[int(index)]


def _expert_targets(config: ModelConfig, layer: str) -> dict[str, tuple[str, int]]:
    """A mixture-of-experts layer's router and per-expert projections → ``SparseMoe``'s stacked
    parameters, expert e's matrix named ``PARAM.e`` (Mixtral's ``block_sparse_moe`` with w1 gate,
    w3 up, w2 down; Qwen3-MoE's ``mlp`` with gate_proj, up_proj, down_proj; Granite MoE's
    ``input_linear`` and ``output_linear``, stacked as ours, whole)."""
    size = config.moe_intermediate_size
    ours = f"{layer}.mlp"
    if config.model_type == "granitemoe":  # the experts stacked already, in our layout
        moe = f"{layer}.block_sparse_moe"
        return {
            f"{moe}.router.layer.weight": (f"{ours}.router_weight", 0),
            f"{moe}.input_linear.weight": (f"{ours}.experts_gate_up", 0),
            f"{moe}.output_linear.weight": (f"{ours}.experts_down", 0),
        }
    if config.model_type == "mixtral":
        theirs, names = f"{layer}.block_sparse_moe", ("w1", "w3", "w2")
    else:
        theirs, names = f"{layer}.mlp", ("gate_proj", "up_proj", "down_proj")
    targets = {f"{theirs}.gate.weight": (f"{ours}.router_weight", 0)}
    for e in range(config.num_experts):
        gate, up, down = (f"{theirs}.experts.{e}.{name}.weight" for name in names)
        targets[gate] = (f"{ours}.experts_gate_up.{e}", 0)
        targets[up] = (f"{ours}.experts_gate_up.{e}", size)
        targets[down] = (f"{ours}.experts_down.{e}", 0)
    return targets


def _checkpoint_targets(config: ModelConfig) -> dict[str, tuple[str, int]]:
    """Checkpoint weight name → (our parameter name, first row inside it)."""
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    targets: dict[str, tuple[str, int]] = {
        "model.embed_tokens.weight": ("model.embed_tokens.weight", 0),
        "model.norm.weight": ("model.norm.weight", 0),
    }
    if not config.tie_word_embeddings:
        targets["lm_head.weight"] = ("lm_head.weight", 0)
    for i in range(config.num_layers):
        layer = f"model.layers.{i}"
        attn = f"{layer}.self_attn"
        kinds = ("weight", "bias") if config.attention_bias else ("weight",)
        for kind in kinds:
            if config.fused_checkpoint:
                targets[f"{attn}.qkv_proj.{kind}"] = (f"{attn}.qkv_proj.{kind}", 0)
                continue
            targets[f"{attn}.q_proj.{kind}"] = (f"{attn}.qkv_proj.{kind}", 0)
            targets[f"{attn}.k_proj.{kind}"] = (f"{attn}.qkv_proj.{kind}", q_rows)
            targets[f"{attn}.v_proj.{kind}"] = (f"{attn}.qkv_proj.{kind}", q_rows + kv_rows)
        targets[f"{attn}.o_proj.weight"] = (f"{attn}.o_proj.weight", 0)
        if config.qk_norm:
            targets[f"{attn}.q_norm.weight"] = (f"{attn}.q_norm.weight", 0)
            targets[f"{attn}.k_norm.weight"] = (f"{attn}.k_norm.weight", 0)
        norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
        if config.post_norms:
            norms = ("post_attention_layernorm", "post_feedforward_layernorm")
        elif config.sandwich_norms:
            norms = (*norms, "pre_feedforward_layernorm", "post_feedforward_layernorm")
        mlp = f"{layer}.mlp"
        if i in config.moe_layers:
            targets.update(_expert_targets(config, layer))
        elif config.fused_checkpoint:  # gate rows first, then up: our order
            targets[f"{mlp}.gate_up_proj.weight"] = (f"{mlp}.gate_up_proj.weight", 0)
        else:
            targets[f"{mlp}.gate_proj.weight"] = (f"{mlp}.gate_up_proj.weight", 0)
            targets[f"{mlp}.up_proj.weight"] = (
                f"{mlp}.gate_up_proj.weight",
                config.intermediate_size,
            )
        if i not in config.moe_layers:
            targets[f"{mlp}.down_proj.weight"] = (f"{mlp}.down_proj.weight", 0)
        for norm in norms:
            targets[f"{layer}.{norm}.weight"] = (f"{layer}.{norm}.weight", 0)
    return targets

"""An fp8 checkpoint's quantization, read from its ``config.json``, and its weights made whole.

Two formats carry the fp8 checkpoints users download, and both name what they did in
``config.json``'s ``quantization_config``:

- ``quant_method: "fp8"`` (AutoFP8, transformers' ``FineGrainedFP8``): a per-tensor
  ``weight_scale`` per projection, or with ``weight_block_size: [n, k]`` a ``weight_scale_inv``
  of one scale per ``n x k`` block (Qwen3-*-FP8, DeepSeek's format); ``activation_scheme``
  ``dynamic`` or ``static`` (an ``input_scale`` per projection); ``ignored_layers`` or
  ``modules_to_not_convert`` left in 16 bits.
- ``quant_method: "compressed-tensors"`` with ``format: "float-quantized"`` (llm-compressor,
  the ``*-FP8-dynamic`` checkpoints): one config group of 8-bit float weights with strategy
  ``tensor``, ``channel`` (a ``[out, 1]`` scale) or ``block``, and input activations 8-bit float
  ``token`` dynamic, ``tensor`` static, or none (weights only); ``ignore`` lists modules by name
  or ``re:`` pattern.

Either way a projection's stored value is ``weight (float8_e4m3fn) * scale`` broadcast over
its rows (tensor, channel) or blocks. ``Fp8Weights`` joins each weight with its scales as the
loader streams the checkpoint's tensors, whatever their order, into a ``QuantizedWeight``:
per-row scales where the scheme has them (what ``fp8_linear.Fp8Linear`` computes with), or the
weight dequantized for a block scheme (no block-scaled GEMM is built). Any other quantization
(AWQ, GPTQ, bitsandbytes, integer compressed-tensors) is refused by name. The scales of an fp8
KV cache that some of these checkpoints carry are passed over: the cache holds the compute
dtype on a GPU.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from services.models.config import with_overrides
from services.models.model_file_error import ModelFileError, read_json_object
from services.types import EngineConfigError

FP8_MAX = 448.0
"""The largest finite float8_e4m3fn value: a scale maps a row's largest magnitude onto it."""

WeightStrategy = Literal["tensor", "channel", "block"]
ActivationScheme = Literal["dynamic", "static", "none"]
_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")
KV_CACHE_SCALE_SUFFIXES = (
    ".k_scale", ".v_scale", ".kv_scale", ".q_scale", ".prob_scale", ".output_scale",
)  # fmt: skip
"""The scales of an fp8 KV cache (and of attention's inputs) that llm-compressor and ModelOpt
store beside the weights. pdserve's GPU cache holds the compute dtype, so they are not used:
``Fp8Weights`` drops them (counted in ``dropped``) rather than refuse the checkpoint."""


@dataclass(frozen=True)
class Fp8Checkpoint:
    """What ``quantization_config`` says of an fp8 checkpoint."""

    method: str
    """``fp8`` or ``compressed-tensors``: the key ``config.json`` names it by."""
    weights: WeightStrategy
    block: tuple[int, int] | None
    """(rows, columns) of a block of one scale, for ``block``."""
    activations: ActivationScheme
    """How the checkpoint's inputs were quantized: per token at run time, by a stored
    per-tensor ``input_scale``, or not at all (weights only)."""
    ignored: tuple[str, ...]
    """Modules left in 16 bits: names, or ``re:``-prefixed patterns (compressed-tensors)."""

    def is_ignored(self, module: str) -> bool:
        """Whether the checkpoint's module ``module`` (``model.layers.0.self_attn.q_proj``) is
        stored unquantized."""
        for entry in self.ignored:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], module):
                    return True
            elif module == entry or module.endswith(f".{entry}"):
                return True
        return False

    def describe(self) -> str:
        scales = f"{self.block[0]}x{self.block[1]} blocks" if self.block else self.weights
        return f"{self.method} fp8 (weight scales per {scales}, activations {self.activations})"


def read_fp8_checkpoint(
    model_dir: Path, overrides: Mapping[str, Any] | None = None
) -> Fp8Checkpoint | None:
    """The fp8 scheme of the checkpoint in ``model_dir``, or None where its ``config.json`` has
    no ``quantization_config`` (or where it is a GGUF file, whose quantization the GGUF loader
    reads); ``overrides`` (``hf_overrides``) apply to it as to the rest of the config.
    ``EngineConfigError`` naming a quantization pdserve does not load; ``ModelFileError`` for a
    ``quantization_config`` it cannot read."""
    path = model_dir / "config.json"
    if not path.is_file():
        return None
    raw = with_overrides(read_json_object(path), overrides).get("quantization_config")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ModelFileError(path, "quantization_config is not a JSON object")
    method = raw.get("quant_method")
    if method == "fp8":
        return _fp8_method(path, raw)
    if method == "compressed-tensors":
        return _compressed_tensors(path, raw)
    raise EngineConfigError(
        f"{path}: quantization_config.quant_method {method!r} is not supported; pdserve loads "
        "fp8 checkpoints (quant_method fp8, or compressed-tensors float8) and GGUF files"
    )


def _fp8_method(path: Path, raw: dict[str, Any]) -> Fp8Checkpoint:
    activations = raw.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise ModelFileError(
            path, f"quantization_config.activation_scheme {activations!r}: dynamic or static"
        )
    block = raw.get("weight_block_size")
    if block is not None:
        block = _block(path, "quantization_config.weight_block_size", block)
    ignored = raw.get("ignored_layers") or raw.get("modules_to_not_convert") or []
    return Fp8Checkpoint(
        method="fp8",
        weights="block" if block else "tensor",
        block=block,
        activations=activations,
        ignored=_names(path, "quantization_config.ignored_layers", ignored),
    )


def _compressed_tensors(path: Path, raw: dict[str, Any]) -> Fp8Checkpoint:
    fmt = raw.get("format")
    groups = raw.get("config_groups")
    if fmt not in ("float-quantized", "naive-quantized") or not isinstance(groups, dict):
        raise EngineConfigError(
            f"{path}: compressed-tensors format {fmt!r} is not supported; pdserve loads its "
            "float-quantized (fp8) checkpoints"
        )
    if len(groups) != 1:
        raise EngineConfigError(
            f"{path}: compressed-tensors with {len(groups)} config_groups is not supported "
            "(one group of fp8 weights is)"
        )
    (group,) = groups.values()
    weights = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(weights, dict):
        raise ModelFileError(path, "quantization_config.config_groups: a group has no weights")
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise EngineConfigError(
            f"{path}: compressed-tensors weights of {weights.get('num_bits')}-bit "
            f"{weights.get('type')} are not supported; pdserve loads 8-bit float (fp8) ones"
        )
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise EngineConfigError(
            f"{path}: compressed-tensors weight strategy {strategy!r} is not supported "
            "(tensor, channel and block are)"
        )
    block = None
    if strategy == "block":
        block = _block(path, "weights.block_structure", weights.get("block_structure"))
    inputs = group.get("input_activations")
    if inputs is None:
        activations: ActivationScheme = "none"
    elif isinstance(inputs, dict) and inputs.get("type") == "float" and inputs.get("num_bits") == 8:
        activations = "dynamic" if inputs.get("dynamic") else "static"
    else:
        raise EngineConfigError(
            f"{path}: compressed-tensors input activations {inputs!r} are not supported "
            "(8-bit float, dynamic or static, or none)"
        )
    return Fp8Checkpoint(
        method="compressed-tensors",
        weights=strategy,
        block=block,
        activations=activations,
        ignored=_names(path, "quantization_config.ignore", raw.get("ignore") or []),
    )


def _block(path: Path, key: str, value: object) -> tuple[int, int]:
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise ModelFileError(path, f"{key} must be two positive integers, got {value!r}")
    return value[0], value[1]


def _names(path: Path, key: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ModelFileError(path, f"{key} must be a list of module names, got {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class QuantizedWeight:
    """A projection's weight as fp8 values and one scale per row (the stored value of row r is
    ``values[r] * row_scales[r]``), with the checkpoint's static ``input_scale`` if it has one."""

    values: torch.Tensor
    """float8_e4m3fn ``[out, in]``."""
    row_scales: torch.Tensor
    """float32 ``[out]``."""
    input_scale: float | None

    def dequantize(self) -> torch.Tensor:
        """float32 ``[out, in]``."""
        return self.values.float() * self.row_scales[:, None]


def quantize_rows(weight: torch.Tensor) -> QuantizedWeight:
    """``weight`` ``[out, in]`` as fp8 with one scale per row, the row's largest magnitude over
    ``FP8_MAX`` (vLLM's ``--quantization fp8`` quantizes per tensor; per row keeps a row of
    small weights from losing its mantissa to another row's outlier)."""
    weight = weight.float()
    scales = weight.abs().amax(dim=1).clamp_min(1e-12) / FP8_MAX  # [out]
    values = (weight / scales[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight(values=values, row_scales=scales, input_scale=None)


class Fp8Weights:
    """Joins each quantized projection's weight with its scales as the checkpoint's tensors go
    by: ``push`` takes every tensor and gives back what is complete. A projection is complete
    when its weight and its weight scale (and, for static activations, its input scale) have
    come; a tensor of a module the scheme leaves in 16 bits passes straight through."""

    def __init__(self, scheme: Fp8Checkpoint) -> None:
        self.scheme = scheme
        self._pending: dict[str, dict[str, tuple[torch.Tensor, Path]]] = {}
        """Checkpoint module name → its tensors seen so far, by suffix."""
        self.dropped = 0
        """KV cache scales passed over (``KV_CACHE_SCALE_SUFFIXES``)."""

    def push(
        self, name: str, tensor: torch.Tensor, origin: Path
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight, Path]]:
        """``(weight name, its tensor or its QuantizedWeight, file)`` for each weight complete
        now: a quantized projection's comes once its weight and scales are all in."""
        if name.endswith(KV_CACHE_SCALE_SUFFIXES):
            self.dropped += 1
            return
        suffix = next((s for s in _SCALE_SUFFIXES if name.endswith(s)), None)
        if suffix is None and (tensor.dtype != torch.float8_e4m3fn or not name.endswith(".weight")):
            yield name, tensor, origin
            return
        module = name[: -len(suffix or ".weight")]
        parts = self._pending.setdefault(module, {})
        parts[suffix or ".weight"] = (tensor, origin)
        if self._is_complete(parts):
            del self._pending[module]
            yield f"{module}.weight", self._join(module, parts), parts[".weight"][1]

    def leftovers(self) -> list[str]:
        """What never completed: a weight without its scale, or a scale without its weight."""
        return sorted(f"{module}{suffix}" for module, p in self._pending.items() for suffix in p)

    def _is_complete(self, parts: dict[str, tuple[torch.Tensor, Path]]) -> bool:
        scale = ".weight_scale_inv" if self.scheme.method == "fp8" and self.scheme.block else ""
        has_scale = (scale or ".weight_scale") in parts
        needs_input = self.scheme.activations == "static"
        return ".weight" in parts and has_scale and (not needs_input or ".input_scale" in parts)

    def _join(
        self, module: str, parts: dict[str, tuple[torch.Tensor, Path]]
    ) -> torch.Tensor | QuantizedWeight:
        values, origin = parts[".weight"]
        if values.dtype != torch.float8_e4m3fn or values.dim() != 2:
            raise ModelFileError(
                origin,
                f"weight {module}.weight is {values.dtype} {tuple(values.shape)}; the "
                "quantization_config says a 2-D float8_e4m3fn",
            )
        scale_key = ".weight_scale_inv" if ".weight_scale_inv" in parts else ".weight_scale"
        scale = parts[scale_key][0].float()
        rows, cols = values.shape
        input_scale = None
        if ".input_scale" in parts:
            input_scale = float(parts[".input_scale"][0].float().max())
        if self.scheme.block is not None:
            return _dequantize_blocks(values, scale, self.scheme.block, module, origin)
        if scale.numel() == 1:
            row_scales = scale.reshape(1).expand(rows).contiguous()
        elif scale.numel() == rows:
            row_scales = scale.reshape(rows)
        else:
            raise ModelFileError(
                origin,
                f"{module}{scale_key} has shape {tuple(scale.shape)}: one scale, or one per "
                f"row of the {rows} x {cols} weight",
            )
        return QuantizedWeight(values=values, row_scales=row_scales, input_scale=input_scale)


def _dequantize_blocks(
    values: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], module: str, origin: Path
) -> torch.Tensor:
    """float32 ``[out, in]`` from fp8 ``values`` and ``scales`` ``[ceil(out/n), ceil(in/k)]``
    (the last block of a row or column may be partial)."""
    rows, cols = values.shape
    n, k = block
    expected = (-(-rows // n), -(-cols // k))
    if tuple(scales.shape) != expected:
        raise ModelFileError(
            origin,
            f"{module} block scales have shape {tuple(scales.shape)}, expected {expected} for "
            f"a {rows} x {cols} weight in {n} x {k} blocks",
        )
    full = scales.repeat_interleave(n, dim=0)[:rows].repeat_interleave(k, dim=1)[:, :cols]
    return values.float() * full

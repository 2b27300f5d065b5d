"""fp8 checkpoints written from a 16-bit one, as AutoFP8 and llm-compressor lay them out, and the
16-bit checkpoint of exactly the values they store (the reference a dequantizing load must
equal). Written here from the formats' descriptions, independently of the loader's reading."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STATIC_INPUT_SCALE = 0.02


def _quantize(
    weight: torch.Tensor, strategy: str, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 values, the scale tensor as stored, the dequantized float32 weight)."""
    w = weight.float()
    rows, cols = w.shape
    if strategy == "tensor":
        scale = w.abs().max() / FP8_MAX
        full = scale.expand(rows, cols)
    elif strategy == "channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1e-12)  # [out, 1]
        full = scale.expand(rows, cols)
    else:
        n, k = block
        scale = torch.empty(-(-rows // n), -(-cols // k))
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                tile = w[i * n : (i + 1) * n, j * k : (j + 1) * k]
                scale[i, j] = tile.abs().max().clamp_min(1e-12) / FP8_MAX
        full = scale.repeat_interleave(n, 0)[:rows].repeat_interleave(k, 1)[:, :cols]
    values = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values, scale, values.float() * full


def write_fp8_checkpoint(
    src: Path,
    out: Path,
    *,
    method: str = "compressed-tensors",
    strategy: str = "channel",
    activations: str = "dynamic",
    block: tuple[int, int] = (32, 64),
    ignore: tuple[str, ...] = ("lm_head",),
) -> tuple[Path, Path]:
    """Writes ``out/fp8`` (the fp8 checkpoint of ``src``) and ``out/reference`` (``src`` with each
    quantized projection replaced by its dequantized values, in float32); returns both.
    ``method``: ``fp8`` (AutoFP8 / transformers: per-tensor ``weight_scale``, or
    ``weight_scale_inv`` per block) or ``compressed-tensors``; ``activations``: dynamic, static
    (an ``input_scale`` per projection) or none (compressed-tensors weight-only)."""
    fp8_dir, ref_dir = out / "fp8", out / "reference"
    for directory in (fp8_dir, ref_dir):
        shutil.copytree(src, directory)
        (directory / "model.safetensors").unlink()
    tensors = load_file(src / "model.safetensors")
    fp8_tensors: dict[str, torch.Tensor] = {}
    ref_tensors: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        quantized = name.endswith(".weight") and module.split(".")[-1] in PROJECTIONS
        if not quantized or any(module == i or module.endswith(f".{i}") for i in ignore):
            fp8_tensors[name] = tensor
            ref_tensors[name] = tensor.float()
            continue
        values, scale, dequantized = _quantize(tensor, strategy, block)
        fp8_tensors[name] = values
        ref_tensors[name] = dequantized
        if method == "fp8" and strategy == "block":
            fp8_tensors[f"{module}.weight_scale_inv"] = scale
        elif method == "fp8":
            fp8_tensors[f"{module}.weight_scale"] = scale.reshape(())  # AutoFP8: a 0-d scale
        else:
            fp8_tensors[f"{module}.weight_scale"] = scale.reshape(1) if scale.dim() == 0 else scale
        if activations == "static":
            fp8_tensors[f"{module}.input_scale"] = torch.tensor([STATIC_INPUT_SCALE])
    save_file(fp8_tensors, fp8_dir / "model.safetensors")
    save_file(ref_tensors, ref_dir / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = _quantization_config(
        method, strategy, activations, block, ignore
    )
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2))
    return fp8_dir, ref_dir


def _quantization_config(
    method: str, strategy: str, activations: str, block: tuple[int, int], ignore: tuple[str, ...]
) -> dict[str, object]:
    if method == "fp8":
        config: dict[str, object] = {
            "quant_method": "fp8",
            "activation_scheme": activations,
            "ignored_layers": list(ignore),
        }
        if strategy == "block":
            config["weight_block_size"] = list(block)
        return config
    weights: dict[str, object] = {
        "num_bits": 8,
        "type": "float",
        "strategy": strategy,
        "symmetric": True,
        "dynamic": False,
    }
    if strategy == "block":
        weights["block_structure"] = list(block)
    inputs = None
    if activations != "none":
        inputs = {
            "num_bits": 8,
            "type": "float",
            "strategy": "token" if activations == "dynamic" else "tensor",
            "symmetric": True,
            "dynamic": activations == "dynamic",
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
        },
        "ignore": list(ignore),
    }

"""A random PEFT LoRA adapter for a model, written as PEFT saves one (``adapter_config.json``,
``adapter_model.safetensors``): what the tests and ``benchmarks/lora_overhead.py`` run, since
no adapter comes from a model hub here."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.models.config import ModelConfig
from services.models.lora import TARGETS, projection_shapes

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")

Deltas = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
"""(layer, PEFT module name) -> (lora_A [r, in], lora_B [out, r])."""


def write_random_adapter(
    directory: Path,
    config: ModelConfig,
    *,
    targets: tuple[str, ...] = TARGETS,
    rank: int = 4,
    alpha: float = 8.0,
    std: float = 0.2,
    seed: int = 0,
    extra_config: dict[str, object] | None = None,
    extra_tensors: dict[str, torch.Tensor] | None = None,
) -> Deltas:
    """An adapter of ``config``'s model in ``directory``: every layer's ``targets``, A and B
    drawn from N(0, ``std``) with ``seed``; ``extra_config`` and ``extra_tensors`` add to (or
    override) what PEFT would write. Returns the A and B written."""
    generator = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(config)
    deltas: Deltas = {}
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config.num_layers):
        for name in targets:
            in_features, out_features = shapes[name]
            a = torch.randn(rank, in_features, generator=generator) * std
            b = torch.randn(out_features, rank, generator=generator) * std
            deltas[(layer, name)] = (a, b)
            block = "self_attn" if name in _ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = b
    tensors.update(extra_tensors or {})
    directory.mkdir(parents=True, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "fan_in_fan_out": False,
        **(extra_config or {}),
    }
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return deltas

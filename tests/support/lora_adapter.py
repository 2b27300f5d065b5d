"""A PEFT LoRA adapter directory for a tiny test model, written as PEFT saves one."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.models.lora import TARGETS

Deltas = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
"""(layer, PEFT module name) -> (lora_A [r, in], lora_B [out, r])."""


def shapes(config: dict) -> dict[str, tuple[int, int]]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def write_adapter(
    directory: Path,
    model_dir: Path,
    *,
    targets: tuple[str, ...] = TARGETS,
    rank: int = 4,
    alpha: float = 8.0,
    seed: int = 0,
    extra_config: dict | None = None,
    extra_tensors: dict[str, torch.Tensor] | None = None,
) -> Deltas:
    """A PEFT adapter directory as PEFT saves one, with random A and B; returns them."""
    config = json.loads((model_dir / "config.json").read_text())
    generator = torch.Generator().manual_seed(seed)
    deltas: Deltas = {}
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config["num_hidden_layers"]):
        for name in targets:
            in_features, out_features = shapes(config)[name]
            a = torch.randn(rank, in_features, generator=generator) * 0.2
            b = torch.randn(out_features, rank, generator=generator) * 0.2
            deltas[(layer, name)] = (a, b)
            block = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
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

"""A random PEFT LoRA adapter for a tiny test model's directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.models.config import ModelConfig
from services.models.random_lora import Deltas, write_random_adapter

__all__ = ["Deltas", "write_adapter"]


def write_adapter(directory: Path, model_dir: Path, **options: Any) -> Deltas:
    """``write_random_adapter`` for the model in ``model_dir`` (its ``config.json``)."""
    return write_random_adapter(directory, ModelConfig.from_model_dir(model_dir), **options)

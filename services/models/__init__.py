"""Llama-family model code (Llama, Mistral, Qwen2, Qwen3), the safetensors loader, and the
offline tiny-checkpoint builder (``python -m services.models.tiny``)."""

from __future__ import annotations

from services.models.model_file_error import ModelFileError

__all__ = ["ModelFileError"]

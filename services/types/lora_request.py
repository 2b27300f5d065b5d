"""Which LoRA adapter a request runs with: vLLM's ``LoRARequest``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``: a PEFT adapter directory
    (``adapter_config.json`` and ``adapter_model.safetensors``) under a name of its own. The
    engine keys loaded adapters by ``lora_name``; ``lora_int_id`` (>= 1) is kept for vLLM's
    signature. Bad values raise ``ValueError`` naming the field."""

    lora_name: str
    lora_int_id: int
    lora_path: str | os.PathLike[str]

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str | os.PathLike):
            raise ValueError(f"lora_path must be a path, got {self.lora_path!r}")

    @property
    def path(self) -> Path:
        """``lora_path`` made absolute, so that two spellings of one directory compare equal."""
        return Path(self.lora_path).expanduser().resolve()

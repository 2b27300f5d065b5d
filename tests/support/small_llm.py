"""An offline ``LLM`` small enough for a test: float32, 4 sequences of at most 64 tokens, a
4 MiB KV cache; keyword arguments override or add to those."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.engine import LLM


def small_llm(model_dir: Path, **kwargs: Any) -> LLM:
    settings: dict[str, Any] = {
        "dtype": "float32",
        "max_model_len": 64,
        "max_num_seqs": 4,
        "kv_cache_memory": 1 << 22,
    }
    return LLM(model_dir, **(settings | kwargs))

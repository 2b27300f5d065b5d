"""The model's own sampling defaults, as vLLM's ``--generation-config auto`` applies them.

A model directory's ``generation_config.json`` says how its authors sample it (Qwen2.5:
temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05). A request that leaves one of
these fields unset gets the model's value instead of the engine's default; a value the request
sets always wins. The fields read are vLLM's: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` (the default ``max_tokens``). ``do_sample`` is
ignored, as vLLM ignores it. Unlike vLLM, ``max_new_tokens`` does not cap a ``max_tokens`` the
request sets.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class SamplingDefaults:
    """None: the field is not set by the model (the engine's default applies)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    """From ``max_new_tokens``."""

    @classmethod
    def from_generation_config(cls, path: Path) -> SamplingDefaults:
        """``ValueError`` naming the file and field for a value no request could take."""
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path} is not a JSON object")
        values: dict[str, Any] = {}
        for name, key in _KEYS.items():
            value = config.get(key)
            if value is None:
                continue
            check = _CHECKS[name]
            if isinstance(value, bool) or not check(value):
                raise ValueError(f"{path}: {key} = {value!r} is out of range")
            values[name] = value
        if values.get("top_k") in (0, -1):  # 0 and -1 mean "off": the engine's default
            del values["top_k"]
        return cls(**values)

    def as_dict(self) -> dict[str, float | int]:
        """The fields the model sets, by name (for the start-up log)."""
        found = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: value for name, value in found.items() if value is not None}


def _finite(low: float, high: float, low_open: bool = False) -> Callable[[object], bool]:
    def check(value: object) -> bool:
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        return (low < value if low_open else low <= value) and value <= high

    return check


_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_tokens": "max_new_tokens",
}
_CHECKS: dict[str, Callable[[Any], bool]] = {
    "temperature": _finite(0.0, math.inf),
    "top_p": _finite(0.0, 1.0, low_open=True),
    "top_k": lambda value: isinstance(value, int) and -1 <= value < 2**31,  # the proto's int32
    "min_p": _finite(0.0, 1.0),
    "repetition_penalty": _finite(0.0, math.inf, low_open=True),
    "max_tokens": lambda value: isinstance(value, int) and value >= 1,
}


def load_sampling_defaults(setting: str, model_dir: Path) -> SamplingDefaults:
    """``--generation-config``: ``auto`` reads the model directory's file when it has one,
    ``none`` ignores it, and a directory must hold one."""
    if setting == "none":
        return SamplingDefaults()
    if setting == "auto":
        path = model_dir / GENERATION_CONFIG
        if not path.is_file():  # a GGUF file, or a checkpoint without one
            return SamplingDefaults()
        return SamplingDefaults.from_generation_config(path)
    path = Path(setting) / GENERATION_CONFIG
    if not path.is_file():
        raise ValueError(f"--generation-config: {path} does not exist")
    return SamplingDefaults.from_generation_config(path)

"""The error for a checkpoint file that exists but cannot be read as what it claims to be, and
the reader of its JSON files that raises it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ModelFileError(ValueError):
    """A model file (``config.json``, a safetensors shard, a GGUF) that cannot be parsed, or a
    checkpoint whose weights are not the ones its config describes (missing, unexpected, of
    another shape). The message names the file (or the checkpoint's directory): the parser's
    own error (``header too large``, ``Expecting property name``) does not, and a model
    directory holds several files.

    A setting or a kind of model the engine does not support is an ``EngineConfigError``
    instead; a node refuses to start on either, exiting 1 for this one (a file to fix) and 2
    for that one (a flag to change)."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path


def read_json_object(path: Path) -> dict[str, Any]:
    """``path``'s JSON object (``config.json``, ``tokenizer_config.json``...); ``ModelFileError``
    naming the file when it is not valid JSON or holds something else."""
    try:
        value = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFileError(path, f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ModelFileError(path, f"holds a {type(value).__name__}, expected a JSON object")
    return value

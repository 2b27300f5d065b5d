"""The error for a checkpoint file that exists but cannot be read as what it claims to be."""

from __future__ import annotations

from pathlib import Path


class ModelFileError(ValueError):
    """A model file (``config.json``, a safetensors shard, a GGUF) that cannot be parsed. The
    message names the file: the parser's own error (``header too large``, ``Expecting property
    name``) does not, and a model directory holds several files."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path

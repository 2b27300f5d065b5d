"""What a sentence-transformers checkpoint declares of its embeddings: ``modules.json`` lists
its modules; the Pooling module's ``config.json`` sets one ``pooling_mode_*`` flag
(Qwen3-Embedding: ``lasttoken``), and a Normalize module, where listed, L2-normalizes.

Why read it: pdserve pools the last prompt token (``services/engine/pooler.py``). A checkpoint
trained for mean or CLS pooling would get vectors it was never trained to give, close enough in
shape to pass unnoticed; the engine refuses its embedding requests instead, naming the file.
And a request that leaves ``normalize`` unset gets what the checkpoint's modules do, as vLLM
reads them (without ``modules.json``: normalized).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

POOLING_MODULE = "sentence_transformers.models.Pooling"
NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
LAST_TOKEN = "lasttoken"
"""The mode pdserve computes."""


@dataclass(frozen=True)
class DeclaredPooling:
    """A checkpoint's ``modules.json``, as far as embeddings go."""

    mode: str | None
    """``lasttoken``, ``mean_tokens``, ``cls_token``, ... (several joined by ``+``); None
    without a Pooling module."""
    file: Path
    """The file that declares ``mode`` (``modules.json`` where there is no Pooling module)."""
    normalize: bool
    """Whether a Normalize module is listed."""


def declared_pooling(model_dir: Path) -> DeclaredPooling | None:
    """What the checkpoint at ``model_dir`` declares; None where it has no ``modules.json`` (not
    a sentence-transformers checkpoint, or a GGUF file). ``ValueError`` naming the file for one
    that cannot be read."""
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file}: expected a list of modules")
    types = {str(m.get("type")): m for m in modules if isinstance(m, dict)}
    normalize = NORMALIZE_MODULE in types
    if POOLING_MODULE not in types:
        return DeclaredPooling(None, modules_file, normalize)
    config_file = Path(model_dir) / str(types[POOLING_MODULE].get("path", "")) / "config.json"
    config = _read_json(config_file)
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: expected an object")
    modes = sorted(
        key.removeprefix("pooling_mode_")
        for key, on in config.items()
        if key.startswith("pooling_mode_") and on is True
    )
    return DeclaredPooling("+".join(modes) or "none", config_file, normalize)


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot be read as JSON: {exc}") from None

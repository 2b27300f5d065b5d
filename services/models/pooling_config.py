"""The pooling a sentence-transformers checkpoint declares: ``modules.json`` names its Pooling
module, whose ``config.json`` sets one ``pooling_mode_*`` flag (Qwen3-Embedding: ``lasttoken``).

Why read it: pdserve pools the last prompt token (``services/engine/pooler.py``). A checkpoint
trained for mean or CLS pooling would get vectors it was never trained to give, close enough in
shape to pass unnoticed; the engine refuses its embedding requests instead, naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

POOLING_MODULE = "sentence_transformers.models.Pooling"
LAST_TOKEN = "lasttoken"
"""The mode pdserve computes."""


def declared_pooling(model_dir: Path) -> tuple[str, Path] | None:
    """The pooling mode the checkpoint at ``model_dir`` declares (``lasttoken``,
    ``mean_tokens``, ``cls_token``, ...; several joined by ``+``) and the file that declares it;
    None where it declares none (no ``modules.json``, no Pooling module, or a GGUF file).
    ``ValueError`` naming the file for one that cannot be read."""
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_file}: expected a list of modules")
    pooling = [m for m in modules if isinstance(m, dict) and m.get("type") == POOLING_MODULE]
    if not pooling:
        return None
    config_file = Path(model_dir) / str(pooling[0].get("path", "")) / "config.json"
    config = _read_json(config_file)
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: expected an object")
    modes = sorted(
        key.removeprefix("pooling_mode_")
        for key, on in config.items()
        if key.startswith("pooling_mode_") and on is True
    )
    return "+".join(modes) or "none", config_file


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot be read as JSON: {exc}") from None

"""A model directory that differs from another only in its ``config.json``: every other file is
a symlink to the original's, so no weights are copied."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def with_config(source: Path, dest: Path, **keys: Any) -> Path:
    """``dest`` holding ``source``'s files, its ``config.json`` with ``keys`` set."""
    dest.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name != "config.json":
            (dest / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, **keys}))
    return dest

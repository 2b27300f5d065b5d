"""Fixtures the gateway tests share."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from gateway.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Tokenizer:
    """The tiny model's tokenizer, as the gateway loads it."""
    return Tokenizer.from_model_dir(tiny_llama_dir)


@pytest.fixture(scope="module")
def fake_node() -> ModuleType:
    """tests/support/fake_node.py: a node with no model, scripted to answer or fail."""
    from support import fake_node

    return fake_node

"""Node test fixtures."""

from __future__ import annotations

import pytest

import services.node.config


@pytest.fixture
def cuda_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flags naming a CUDA device parse on a machine without one (``--device cuda`` is refused
    there before the model loads): for tests of what such flags configure."""
    monkeypatch.setattr(services.node.config, "check_device", lambda device: None)

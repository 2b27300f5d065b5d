"""Which batches a packed module hands to one of our few-row linear kernels rather than to
oneDNN's: the row count of every call of the kernel's ``linear``."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def count_rows(monkeypatch: pytest.MonkeyPatch, kernel: type[Any]) -> list[int]:
    """Wraps ``kernel.linear`` for the test; the returned list gets each call's ``x.shape[0]``
    (the call still runs the kernel)."""
    calls: list[int] = []
    real_linear = kernel.linear

    def counting(self: Any, x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return real_linear(self, x, *args)  # type: ignore[no-any-return]

    monkeypatch.setattr(kernel, "linear", counting)
    return calls

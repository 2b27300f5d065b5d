"""What the tests of our few-row linear kernels (AMX, bf16, fp32) share: which batches a packed
module hands to a kernel rather than to oneDNN's, and the argument checks every kernel's op makes
(``csrc/few_row_linear_args.h``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


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


def assert_bad_arguments_are_named(
    linear: Callable[..., torch.Tensor], x: torch.Tensor, out_features: int
) -> None:
    """``linear`` (a view's: x, bias, epilogue, other) refuses each bad argument with an error
    that names it, and takes zero rows. ``x``: 4 rows of more than 64 inputs, in the weight's
    dtype."""
    num_rows, in_features = x.shape
    wrong_dtype = torch.float32 if x.dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(RuntimeError, match=f"x must be {_DTYPE_NAMES[x.dtype]}"):
        linear(x.to(wrong_dtype))
    with pytest.raises(RuntimeError, match=rf"x must be \[num_rows, {in_features}\]"):
        linear(x[:, :64].contiguous())
    with pytest.raises(RuntimeError, match="epilogue must be none, silu or mul"):
        linear(x, None, "relu")
    with pytest.raises(RuntimeError, match="other is given exactly when the epilogue is mul"):
        linear(x, None, "mul")
    with pytest.raises(RuntimeError, match=rf"other must be \[{num_rows}, {out_features}\]"):
        linear(x, None, "mul", torch.zeros(num_rows, in_features, dtype=x.dtype))
    with pytest.raises(RuntimeError, match=rf"bias must be \[{out_features}\]"):
        linear(x, torch.zeros(in_features, dtype=x.dtype))
    assert linear(x[:0]).shape == (0, out_features)

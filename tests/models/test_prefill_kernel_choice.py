"""The padded prefill kernel is chosen by timing both on this host: the faster wins, a tie keeps
sdpa, both are timed alternately, and a GPU is not timed at all."""

from __future__ import annotations

import pytest
import torch

from services.models.attention import PADDED_KERNELS, TorchPagedAttention
from services.models.prefill_kernel_choice import choose_padded_kernel, padded_kernel_timer

CPU = torch.device("cpu")


def fake_timer(seconds: dict[str, float], calls: list[str]):
    def time_call(kernel: str) -> float:
        calls.append(kernel)
        return seconds[kernel]

    return time_call


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        ({"sdpa": 0.003, "matmul": 0.020}, "sdpa"),  # an AMX host
        ({"sdpa": 0.017, "matmul": 0.010}, "matmul"),  # an AVX-512 host without AMX
        ({"sdpa": 0.005, "matmul": 0.005}, "sdpa"),  # a tie keeps the one without scores
    ],
)
def test_the_faster_kernel_is_chosen(seconds: dict[str, float], expected: str) -> None:
    backend = TorchPagedAttention(16, 0.125)
    calls: list[str] = []
    choice = choose_padded_kernel(backend, CPU, fake_timer(seconds, calls), repeats=3)
    assert choice.kernel == expected and backend.padded_kernel == expected
    assert choice.seconds == seconds
    # A warm-up of each, then the kernels alternate, so load from elsewhere falls on both.
    assert calls == list(PADDED_KERNELS) * 4
    assert expected in choice.describe()


def test_a_best_call_wins_over_a_slow_one() -> None:
    backend = TorchPagedAttention(16, 0.125)
    times = iter([0.0, 0.0, 0.050, 0.010, 0.002, 0.010, 0.050, 0.010])  # sdpa's second call
    choice = choose_padded_kernel(backend, CPU, lambda kernel: next(times), repeats=3)
    assert choice.kernel == "sdpa" and choice.seconds == {"sdpa": 0.002, "matmul": 0.010}


def test_a_gpu_keeps_sdpa_untimed() -> None:
    backend = TorchPagedAttention(16, 0.125)
    backend.padded_kernel = "matmul"
    calls: list[str] = []
    choice = choose_padded_kernel(backend, torch.device("cuda"), fake_timer({}, calls))
    assert choice.kernel == "sdpa" and backend.padded_kernel == "sdpa" and calls == []


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_the_timer_runs_each_kernel_on_the_models_shapes(cache_dtype: torch.dtype) -> None:
    backend = TorchPagedAttention(16, 0.125)
    outputs: dict[str, torch.Tensor] = {}
    attend = backend.attend_padded

    def recording(*args: object, kernel: str | None = None) -> torch.Tensor:
        assert kernel is not None
        outputs[kernel] = attend(*args, kernel=kernel)  # type: ignore[arg-type]
        return outputs[kernel]

    backend.attend_padded = recording  # type: ignore[method-assign]
    time_call = padded_kernel_timer(
        backend, num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
        cache_dtype=cache_dtype, num_chunks=3, chunk_tokens=20,
    )  # fmt: skip
    for kernel in PADDED_KERNELS:
        time_call(kernel)
    # 3 chunks x 20 query rows x 4 heads x 16, the same attention either way.
    assert outputs["sdpa"].shape == (60, 4, 16)
    torch.testing.assert_close(outputs["matmul"], outputs["sdpa"], atol=1e-5, rtol=1e-5)

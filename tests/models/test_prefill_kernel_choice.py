"""The prefill attention kernel is chosen by timing each of the backend's on this host: the
fastest wins, a tie keeps sdpa, they are timed alternately, a GPU is not timed at all, and the
timer runs each kernel on the same step with the same result."""

from __future__ import annotations

import pytest
import torch

from services.models.attention import PADDED_KERNELS, TorchPagedAttention
from services.models.native_attention import NATIVE_PREFILL, NativePagedAttention
from services.models.native_build import native_kernel_error
from services.models.prefill_kernel_choice import (
    KERNEL_ENV,
    choose_prefill_kernel,
    prefill_kernel_timer,
)

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
    choice = choose_prefill_kernel(backend, CPU, fake_timer(seconds, calls), repeats=3)
    assert choice.kernel == expected and backend.prefill_kernel == expected
    assert choice.seconds == seconds
    # A warm-up of each, then the kernels alternate, so load from elsewhere falls on both.
    assert calls == list(PADDED_KERNELS) * 4
    assert expected in choice.describe()


def test_a_best_call_wins_over_a_slow_one() -> None:
    backend = TorchPagedAttention(16, 0.125)
    times = iter([0.0, 0.0, 0.050, 0.010, 0.002, 0.010, 0.050, 0.010])  # sdpa's second call
    choice = choose_prefill_kernel(backend, CPU, lambda kernel: next(times), repeats=3)
    assert choice.kernel == "sdpa" and choice.seconds == {"sdpa": 0.002, "matmul": 0.010}


def test_a_gpu_keeps_sdpa_untimed() -> None:
    backend = TorchPagedAttention(16, 0.125)
    backend.prefill_kernel = "matmul"
    calls: list[str] = []
    choice = choose_prefill_kernel(backend, torch.device("cuda"), fake_timer({}, calls))
    assert choice.kernel == "sdpa" and backend.prefill_kernel == "sdpa" and calls == []


def test_the_environment_forces_a_kernel_without_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = TorchPagedAttention(16, 0.125)
    calls: list[str] = []
    monkeypatch.setenv(KERNEL_ENV, "matmul")
    choice = choose_prefill_kernel(backend, CPU, fake_timer({}, calls))
    assert choice.kernel == "matmul" and backend.prefill_kernel == "matmul" and calls == []
    monkeypatch.setenv(KERNEL_ENV, NATIVE_PREFILL)  # the torch backend has no native kernel
    with pytest.raises(ValueError, match=f"{KERNEL_ENV}='native'.*sdpa, matmul"):
        choose_prefill_kernel(backend, CPU, fake_timer({}, calls))


def test_the_native_backend_times_its_own_kernel_too() -> None:
    if native_kernel_error() is not None:
        pytest.skip(f"native kernels unavailable: {native_kernel_error()}")
    backend = NativePagedAttention(16, 0.125)
    assert backend.prefill_kernel == NATIVE_PREFILL  # before any timing
    seconds = {"sdpa": 0.004, "matmul": 0.010, NATIVE_PREFILL: 0.002}
    calls: list[str] = []
    choice = choose_prefill_kernel(backend, CPU, fake_timer(seconds, calls), repeats=2)
    assert calls == [*PADDED_KERNELS, NATIVE_PREFILL] * 3
    assert choice.kernel == NATIVE_PREFILL and backend.prefill_kernel == NATIVE_PREFILL
    seconds[NATIVE_PREFILL] = 0.005  # an AMX host, where torch's flash kernel can win
    choice = choose_prefill_kernel(backend, CPU, fake_timer(seconds, []), repeats=2)
    assert choice.kernel == "sdpa" and backend.prefill_kernel == "sdpa"


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)],
)
def test_the_timer_runs_each_kernel_on_the_models_shapes(
    dtype: torch.dtype, cache_dtype: torch.dtype, native: bool
) -> None:
    if native and native_kernel_error() is not None:
        pytest.skip(f"native kernels unavailable: {native_kernel_error()}")
    backend = NativePagedAttention(16, 0.125) if native else TorchPagedAttention(16, 0.125)
    outputs: dict[str, list[torch.Tensor]] = {}
    time_call = prefill_kernel_timer(
        backend, num_heads=4, num_kv_heads=2, head_dim=16, dtype=dtype,
        cache_dtype=cache_dtype, steps=((3, 20), (1, 50)), outputs=outputs,
    )  # fmt: skip
    for kernel in backend.prefill_kernels:
        assert time_call(kernel) > 0
    # Both steps: 3 chunks x 20 query rows, then one of 50, x 4 heads x 16, the same attention
    # whichever kernel ran.
    assert sorted(outputs) == sorted(backend.prefill_kernels)
    assert [out.shape for out in outputs["sdpa"]] == [(60, 4, 16), (50, 4, 16)]
    for kernel in backend.prefill_kernels:
        for out, reference in zip(outputs[kernel], outputs["sdpa"], strict=True):
            torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)

"""Fixtures shared by every test directory: tiny checkpoints, skipping GPU tests on CPU, and
Triton's interpreter on CPU."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# The Triton attention kernels run on CPU tensors under Triton's interpreter, which Triton reads
# when it is first imported (transformers imports it through torch._dynamo): set it before
# anything else is imported. With CUDA the kernels are compiled for the GPU instead.
if os.environ.get("TRITON_INTERPRET") is None and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from services.models.tiny import build_tiny_model  # noqa: E402 (after TRITON_INTERPRET)

TinyModelFactory = Callable[..., Path]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> TinyModelFactory:
    """``make(arch="llama", size="tiny", sharded=False) -> Path``, built once per session."""
    built: dict[tuple[str, str, bool], Path] = {}

    def make(arch: str = "llama", size: str = "tiny", sharded: bool = False) -> Path:
        key = (arch, size, sharded)
        if key not in built:
            out_dir = tmp_path_factory.mktemp(f"{arch}-{size}{'-sharded' if sharded else ''}")
            # 2MB splits the ~8MB tiny checkpoint into several shards.
            built[key] = build_tiny_model(
                out_dir, arch=arch, size=size, max_shard_size="2MB" if sharded else None
            )
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory("llama")

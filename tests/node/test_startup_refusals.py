"""A node that cannot run as configured says why in one line and exits (1: a file or this
machine; 2: a flag value), never with a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.local_ports import free_ports
from services.models.native_build import native_kernel_error


def test_a_native_kernel_variant_the_node_cannot_run_is_named_with_its_setting(
    tiny_llama_dir: Path,
) -> None:
    if native_kernel_error() is not None:
        pytest.skip(f"native kernel unavailable here: {native_kernel_error()}")
    (port,) = free_ports(1)
    argv = [sys.executable, "-m", "decode_node", "--role", "colocated",
            "--model", str(tiny_llama_dir), "--grpc-port", str(port),
            "--kv-cache-memory", "4MiB", "--max-model-len", "128", "--dtype", "float32",
            "--attention-backend", "native"]  # fmt: skip
    env = {**os.environ, "PDSERVE_NATIVE_ISA": "avx9"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "PDSERVE_NATIVE_ISA: unknown native kernel variant 'avx9'" in proc.stderr
    assert "Traceback" not in proc.stderr


def _start_colocated(model_dir: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    (port,) = free_ports(1)
    argv = [sys.executable, "-m", "decode_node", "--role", "colocated",
            "--model", str(model_dir), "--grpc-port", str(port), "--dtype", "float32",
            "--kv-cache-memory", "4MiB", *flags]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


def test_a_corrupt_weights_file_is_named_in_one_line_with_exit_1(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model_dir = Path(shutil.copytree(tiny_llama_dir, tmp_path / "model"))
    (model_dir / "model.safetensors").write_bytes(b"\xff" * 100)
    proc = _start_colocated(model_dir, "--max-model-len", "128")
    assert proc.returncode == 1, proc.stderr
    assert f"--model: {model_dir}/model.safetensors: not a valid safetensors file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_flag_the_model_refuses_is_named_in_one_line_with_exit_2(tiny_llama_dir: Path) -> None:
    proc = _start_colocated(tiny_llama_dir, "--max-model-len", "100000")
    assert proc.returncode == 2, proc.stderr
    assert "--max-model-len=100000 exceeds what the model supports" in proc.stderr
    assert "Traceback" not in proc.stderr

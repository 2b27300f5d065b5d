"""A node that cannot run as configured says why in one line and exits 1, never a traceback."""

from __future__ import annotations

import os
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

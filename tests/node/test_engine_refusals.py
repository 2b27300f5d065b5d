"""Start-up turns the engine's refusals of its inputs (``EngineConfigError``, ``ModelFileError``,
an ``OSError`` for a file) into one line and an exit code, and only those: any other error out of
the engine's construction is a bug, and keeps its type and its traceback."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.local_ports import free_ports
from services.async_engine import AsyncEngine
from services.node import runtime
from services.node.config import NodeConfig, parse_node_config
from services.node.metrics import NodeMetrics
from services.node.runtime import EngineRefusedError, NodeServerRef, NodeServices, start_node
from services.types import EngineConfigError, Role
from support.lora_adapter import write_adapter

GiB = 1 << 30


def make_argv(model_dir: Path) -> list[str]:
    return ["--role", "colocated", "--model", str(model_dir), "--host", "127.0.0.1",
            "--grpc-port", "0", "--kv-transport", "loopback", "--dtype", "float32",
            "--attention-backend", "torch", "--max-model-len", "64",
            "--kv-cache-memory", "4MiB"]  # fmt: skip


def make_config(model_dir: Path, kv_cache_memory: int | None = None) -> NodeConfig:
    config = parse_node_config(make_argv(model_dir), {}, role=Role.DECODE)
    if kv_cache_memory is not None:
        # Past parse_node_config's own checks, as a value this machine could not foresee.
        cache = dataclasses.replace(config.engine.cache, kv_cache_memory=kv_cache_memory)
        engine = dataclasses.replace(config.engine, cache=cache)
        config = dataclasses.replace(config, engine=engine)
    return config


def no_role(
    config: NodeConfig, engine: AsyncEngine, server: NodeServerRef, metrics: NodeMetrics
) -> NodeServices:
    raise AssertionError("the role is built only once the engine is")


def engine_raising(monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    def build(config: object) -> object:
        raise error

    monkeypatch.setattr(runtime, "EngineCore", build)


def test_an_engine_config_error_is_a_refusal_naming_the_flag_with_exit_2(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine_raising(monkeypatch, EngineConfigError("max_num_seqs must be a positive integer"))
    with pytest.raises(EngineRefusedError) as refusal:
        asyncio.run(start_node(make_config(tiny_llama_dir), no_role))
    assert refusal.value.exit_code == 2
    assert str(refusal.value) == "--max-num-seqs must be a positive integer"


def test_an_unexpected_value_error_from_the_engine_keeps_its_traceback(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine_raising(monkeypatch, ValueError("too many values to unpack (expected 2)"))
    with pytest.raises(ValueError, match="too many values to unpack") as raised:
        asyncio.run(start_node(make_config(tiny_llama_dir), no_role))
    assert not isinstance(raised.value, EngineRefusedError)
    assert raised.value.__traceback__ is not None


def test_run_lets_an_unexpected_value_error_out_instead_of_exiting_2(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine_raising(monkeypatch, ValueError("math domain error"))
    with pytest.raises(ValueError, match="math domain error"):
        runtime.run(make_config(tiny_llama_dir), no_role)


def test_a_kv_cache_the_process_cannot_allocate_is_refused_naming_the_flag(
    tiny_llama_dir: Path,
) -> None:
    # 2**60 bytes (2**58 a layer) is beyond any address space: the allocator fails on any host.
    config = make_config(tiny_llama_dir, kv_cache_memory=2**60)
    with pytest.raises(EngineRefusedError) as refusal:
        asyncio.run(start_node(config, no_role))
    assert refusal.value.exit_code == 2
    message = str(refusal.value)
    assert message.startswith("--kv-cache-memory: cannot allocate a KV cache of ")
    assert "lower --kv-cache-memory" in message and "\n" not in message


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@pytest.mark.slow
@pytest.mark.skipif(_physical_memory() < 16 * GiB, reason="needs 16 GiB of memory to ask 12")
def test_a_node_under_an_address_space_limit_refuses_its_kv_cache_in_one_line(
    tiny_llama_dir: Path,
) -> None:
    """``ulimit -v 8GiB`` and ``--kv-cache-memory 12GiB``: the flag passes the check against
    this machine's memory, and the allocation fails (before any page is touched)."""

    def limit_address_space() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (8 * GiB, 8 * GiB))

    (port,) = free_ports(1)
    argv = [sys.executable, "-m", "decode_node", "--role", "colocated",
            "--model", str(tiny_llama_dir), "--host", "127.0.0.1", "--grpc-port", str(port),
            "--dtype", "float32", "--attention-backend", "torch", "--max-model-len", "64",
            "--kv-cache-memory", "12GiB"]  # fmt: skip
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, preexec_fn=limit_address_space
    )
    assert proc.returncode == 2, proc.stderr
    assert f"--kv-cache-memory: cannot allocate a KV cache of {12 * GiB} bytes" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_adapter_the_engine_cannot_apply_stops_the_start_naming_the_flag(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    adapter = tmp_path / "wide"
    write_adapter(adapter, tiny_llama_dir, rank=32)  # above --max-lora-rank 16
    argv = [*make_argv(tiny_llama_dir), "--lora-modules", f"sql={adapter}"]
    with pytest.raises(EngineRefusedError) as refusal:
        asyncio.run(start_node(parse_node_config(argv, {}, role=Role.DECODE), no_role))
    assert refusal.value.exit_code == 2
    message = str(refusal.value)
    assert (
        message.startswith("--lora-modules sql=")
        and "rank 32 is above --max-lora-rank 16" in message
    )
    with pytest.raises(SystemExit):
        parse_node_config([*make_argv(tiny_llama_dir), "--max-loras", "2"], {}, role=Role.DECODE)
    with pytest.raises(SystemExit):
        parse_node_config([*make_argv(tiny_llama_dir), "--lora-modules", "no-path"], {})


def test_enable_lora_turns_lora_on_without_adapters(tiny_llama_dir: Path) -> None:
    """vLLM's ``--enable-lora``: adapters come later, by the gateway's run-time loads."""
    assert parse_node_config(make_argv(tiny_llama_dir), {}).engine.lora is None
    lora = parse_node_config([*make_argv(tiny_llama_dir), "--enable-lora"], {}).engine.lora
    assert lora is not None and (lora.max_loras, lora.max_lora_rank, lora.lora_modules) == (
        1, 16, ())  # fmt: skip
    env = {"PDSERVE_ENABLE_LORA": "1", "PDSERVE_MAX_LORAS": "3"}
    lora = parse_node_config(make_argv(tiny_llama_dir), env).engine.lora
    assert lora is not None and lora.max_loras == 3
    with pytest.raises(SystemExit):  # 0 is no count, not the default
        parse_node_config([*make_argv(tiny_llama_dir), "--enable-lora", "--max-loras", "0"], {})

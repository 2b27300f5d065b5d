"""KV caches registered where they live: host, shared memory, or (a fake) CUDA device."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from kv_transfer import KvTransport, available_transports, make_transport, run_self_test
from kv_transfer.loopback import LoopbackTransport
from kv_transfer.memory import MemoryKind, UnsupportedMemoryError
from services.node import kv_regions
from services.node.kv_regions import layer_memory, open_kv_transport, region_name

SHAPE = (2, 8, 16, 2, 8)  # [2, blocks, block_size, kv_heads, head_dim]


class FakeCudaLayer:
    """Stands in for a CUDA KV layer on a CPU host: ``view`` chains and the CUDA array
    interface a transport reads, with a pointer no host code may touch."""

    is_cuda = True

    def __init__(self) -> None:
        self.device = torch.device("cuda", 0)

    def view(self, *args: object) -> FakeCudaLayer:
        return self

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (4096,), "typestr": "|u1", "data": (0x7F0000000000, False), "version": 3}


def caches(num_layers: int = 2) -> list[torch.Tensor]:
    return [torch.randn(SHAPE, dtype=torch.bfloat16) for _ in range(num_layers)]


@pytest.mark.parametrize("name", ["loopback", "shm"])
def test_host_caches_are_registered_in_place(name: str) -> None:
    layers = caches()
    before = [layer.clone() for layer in layers]
    transport = open_kv_transport(name, layers)
    try:
        for i, layer in enumerate(layers):
            region = transport._regions[region_name(i)]
            assert region.address == layer.data_ptr() and region.length == layer.nbytes
            assert torch.equal(layer, before[i])  # moved (shm) or not, the contents stay
            expected = MemoryKind.HOST_SHM if name == "shm" else MemoryKind.HOST
            assert region.memory is expected
    finally:
        transport.close()


def pause_of(transport: KvTransport) -> float:
    """The push pause a transport injects (loopback keeps it in its faults)."""
    if isinstance(transport, LoopbackTransport):
        return transport.faults.pause_before_last_s
    return transport.pause_before_last_s  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["loopback", "shm", "ucx"])
def test_the_push_pause_starts_after_the_self_test(name: str, monkeypatch) -> None:
    # The self-test's pushes paused too: every node started with the test knob waited the pause
    # before it served (30 s in a test that kills a node mid-push).
    if name == "ucx" and "ucx" not in available_transports():
        pytest.skip("ucxx is not installed")
    during: list[float] = []

    def spy(transport: KvTransport) -> object:
        during.append(pause_of(transport))
        return run_self_test(transport)

    monkeypatch.setattr(kv_regions, "run_self_test", spy)
    transport = open_kv_transport(name, caches(), push_pause_s=7.5)
    try:
        assert during == [0.0]
        assert pause_of(transport) == 7.5
    finally:
        transport.close()


def test_shm_moves_the_cache_into_shared_memory_keeping_the_tensor() -> None:
    layer = caches(1)[0]
    address = layer.data_ptr()
    transport = make_transport("shm")
    try:
        memory = layer_memory(transport, layer)
        assert layer.data_ptr() != address  # same tensor object, new memory
        assert memory.ctypes.data == layer.data_ptr()
        layer.fill_(1.5)  # the engine's writes land in the shared memory the peer maps
        assert np.array_equal(memory.view(np.uint16), layer.view(torch.uint16).view(-1).numpy())
        del memory
        gc.collect()
        transport.register("kv", layer_memory(transport, layer))  # still shared, not moved again
        assert transport._regions["kv"].memory is MemoryKind.HOST_SHM
    finally:
        transport.close()


@pytest.mark.parametrize("name", ["loopback", "ucx", "shm"])
def test_a_device_cache_on_a_host_transport_is_refused_naming_both(name: str) -> None:
    with pytest.raises(UnsupportedMemoryError, match=f"{name}.*cuda:0.*kv.layer0"):
        open_kv_transport(name, [FakeCudaLayer()])  # type: ignore[list-item]


def test_the_node_exits_with_one_line_not_a_traceback(tmp_path) -> None:
    """What a user sees: start-up refuses with exit code 1 and the reason, no traceback."""
    script = textwrap.dedent(
        """
        import sys
        from services.node import runtime as node_runtime
        from services.node.config import parse_node_config
        from kv_transfer.memory import UnsupportedMemoryError

        class Engine:
            def __init__(self, factory, **options): pass
            def start(self): pass
            def shutdown(self): print("engine shut down", file=sys.stderr)

        def role(config, engine, ref, metrics):
            raise UnsupportedMemoryError(
                "the ucx KV transport cannot carry cuda:0 memory (region 'kv.layer0')")

        node_runtime.AsyncEngine = Engine
        config = parse_node_config(["--role", "decode", "--grpc-port", "0",
                                    "--kv-transport", "ucx"])
        node_runtime.run(config, role)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1, proc.stderr
    assert "cannot carry cuda:0 memory" in proc.stderr
    assert "engine shut down" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_auto_choice_is_logged(
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    cuda_visible: None,
) -> None:
    from kv_transfer import transport_choice
    from services.node.config import parse_node_config
    from services.node.runtime import resolve_kv_transport

    caplog.set_level(logging.INFO)
    # A host whose shared memory gets huge pages as private memory does (shmem_enabled advise).
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    (tmp_path / "shmem_enabled").write_text("always within_size [advise] never deny force\n")
    monkeypatch.setattr(transport_choice, "THP_ROOT", tmp_path)
    host = resolve_kv_transport(parse_node_config(["--role", "decode"], environ={}))
    assert host.kv_transport == "shm"
    cuda = parse_node_config(["--role", "prefill", "--device", "cuda:1"], environ={})
    assert resolve_kv_transport(cuda).kv_transport == "cuda_ipc"
    cluster = parse_node_config(["--role", "decode", "--kv-scope", "cluster"], environ={})
    assert resolve_kv_transport(cluster).kv_transport == "ucx"
    asked = parse_node_config(["--role", "decode", "--kv-transport", "loopback"], environ={})
    assert resolve_kv_transport(asked).kv_transport == "loopback"
    assert "KV transport shm: auto: KV cache in host memory and every peer on this host" in (
        caplog.text
    )
    # One whose shared memory would not get them (this CI host's shmem_enabled never): still
    # shm, and the log says what that costs.
    (tmp_path / "shmem_enabled").write_text("always within_size advise [never] deny force\n")
    no_huge = resolve_kv_transport(parse_node_config(["--role", "decode"], environ={}))
    assert no_huge.kv_transport == "shm"
    assert "every peer on this host; note: shared memory gets no transparent huge pages" in (
        caplog.text
    )

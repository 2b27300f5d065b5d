"""The flags of a test node: the tiny model in float32 on 127.0.0.1, KV over loopback."""

from __future__ import annotations

from pathlib import Path


def node_argv(
    model_dir: Path,
    role: str,
    *,
    kv_memory: str,
    max_model_len: int,
    max_num_batched_tokens: int | None = 64,
    drain_grace_s: float = 1,
) -> list[str]:
    """For ``parse_node_config``: a node started in the test's own process. Its gRPC port is
    0 (the OS picks one and the node reports it); a node run as a child process needs a port
    from ``deploy.local_ports.free_ports`` instead."""
    argv = [
        "--role", role, "--model", str(model_dir), "--dtype", "float32", "--host", "127.0.0.1",
        "--grpc-port", "0", "--kv-transport", "loopback", "--max-model-len", str(max_model_len),
        "--kv-cache-memory", kv_memory, "--drain-grace-s", f"{drain_grace_s:g}",
    ]  # fmt: skip
    if max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    return argv

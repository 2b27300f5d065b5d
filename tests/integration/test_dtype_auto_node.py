"""A colocated node started with ``--dtype auto``: it computes in the dtype the per-CPU cache
names, serves in it, and exports the choice and the measured rates on /metrics, and its KV
cache dtype (``--kv-cache-dtype auto``: bfloat16 on CPU) too."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from decode_node.role import decode_services
from deploy.local_ports import free_ports
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.engine import dtype_choice
from services.engine.dtype_choice import choose_compute_dtype, model_gemm_shapes
from services.models.config import ModelConfig
from services.node.config import parse_node_config
from services.node.runtime import start_node
from services.types import Role


def test_an_auto_node_serves_in_the_chosen_dtype_and_exports_it(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # This CPU's cache says float32 is 3x faster (this host's real rates may say otherwise).
    shapes = model_gemm_shapes(ModelConfig.from_model_dir(tiny_llama_dir), 2048)
    seconds = {"bfloat16": 0.3, "float32": 0.1}
    choose_compute_dtype(
        "auto", "cpu", shapes, cache_dir=tmp_path, time_pass=lambda dtype, s: seconds[dtype]
    )
    monkeypatch.setattr(dtype_choice, "cpu_cache_dir", lambda: tmp_path)
    (metrics_port,) = free_ports(1)
    argv = [
        "--role", "colocated", "--model", str(tiny_llama_dir), "--host", "127.0.0.1",
        "--grpc-port", "0", "--kv-transport", "loopback", "--max-model-len", "64",
        "--kv-cache-memory", "2MiB", "--drain-grace-s", "2", "--metrics-port", str(metrics_port),
    ]  # fmt: skip
    config = parse_node_config(argv, {}, role=Role.DECODE)
    assert config.engine.dtype == "auto"  # the default

    async def main() -> tuple[list[int], str, torch.dtype, str]:
        server, engine = await start_node(config, decode_services)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        try:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            request = decode_pb2.GenerateRequest(
                prompt_token_ids=[5, 6, 7],
                sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
            )
            tokens: list[int] = []
            async for event in stub.Generate(request, timeout=30):
                if event.WhichOneof("event") == "tokens":
                    tokens.extend(event.tokens.token_ids)
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            text = await asyncio.to_thread(
                lambda: urllib.request.urlopen(url, timeout=5).read().decode()
            )
            core = engine.engine
            return tokens, core.kv_layout.dtype, core.kv_caches[0].dtype, text
        finally:
            await channel.close()
            await server.drain()
            engine.shutdown()

    tokens, layout_dtype, cache_dtype, metrics = asyncio.run(main())
    assert len(tokens) == 4
    # fp32 compute, and the KV cache in bf16 (kv_cache_dtype auto on CPU).
    assert layout_dtype == "bfloat16" and cache_dtype == torch.bfloat16
    kv_info = [
        line for line in metrics.splitlines() if line.startswith("pdserve:kv_cache_dtype_info{")
    ]
    assert len(kv_info) == 1 and 'dtype="bfloat16"' in kv_info[0]
    assert 'source="cpu default"' in kv_info[0] and kv_info[0].endswith(" 1.0")
    info = [line for line in metrics.splitlines() if line.startswith("pdserve:compute_dtype_info{")]
    assert len(info) == 1 and 'dtype="float32"' in info[0] and 'source="cached"' in info[0]
    assert info[0].endswith(" 1.0")
    rates = {
        line.split('dtype="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("pdserve:gemm_gflops{")
    }
    flops = sum(s.flops for s in shapes)
    assert rates == pytest.approx({name: flops / s / 1e9 for name, s in seconds.items()})

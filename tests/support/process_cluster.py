"""A local deployment as real processes, started as the launcher starts them
(``deploy.commands``, ``deploy.supervisor``), for the fault tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace

import grpc
import httpx

from deploy.commands import ProcessSpec, local_processes
from deploy.supervisor import Output, Supervisor
from deploy.topology import Topology
from pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc


def completion_body(prompt: list[int], max_tokens: int = 8, **extra: object) -> dict[str, object]:
    """A greedy /v1/completions request for the tiny model that ignores EOS."""
    return {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **extra}  # fmt: skip


class ProcessCluster:
    """Each process of a topology under its own ``Supervisor``, so one can be killed and
    restarted alone; ``with ProcessCluster(...) as cluster:`` runs them all."""

    def __init__(
        self, topology: Topology, extra_argv: Mapping[str, Sequence[str]] | None = None
    ) -> None:
        """``extra_argv``: flags added to the named processes' command lines (a later flag
        wins)."""
        self.topology = topology
        specs = {spec.name: spec for spec in local_processes(topology)}
        for name, extra in (extra_argv or {}).items():
            specs[name] = replace(specs[name], argv=(*specs[name].argv, *extra))
        self.specs: dict[str, ProcessSpec] = specs
        self.running: dict[str, Supervisor] = {}
        self.log = io.StringIO()
        self.base_url = f"http://127.0.0.1:{topology.gateway.http_port}"

    def __enter__(self) -> ProcessCluster:
        """Starts every node, then the gateway, and waits until it sees them all healthy."""
        try:
            self.start(*self.node_names)
            self.start("gateway")
            self.wait_gateway_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def address(self, name: str) -> str:
        port = dict((n.name, n.grpc_port) for n in self.topology.nodes)[name]
        return f"127.0.0.1:{port}"

    def start(self, *names: str) -> None:
        for name in names:
            supervisor = Supervisor(Output(self.log), grace_s=5)
            supervisor.start([self.specs[name]])
            self.running[name] = supervisor
        self.wait_healthy(*names)

    def wait_healthy(self, *names: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        for name in names:
            while not all(target.check(1.0) for target in self.specs[name].health):
                child = self.running[name].children[0]
                assert child.is_alive, f"{name} exited: {self.log.getvalue()[-3000:]}"
                assert time.monotonic() < deadline, f"{name} not healthy"
                time.sleep(0.2)

    @contextlib.contextmanager
    def gateway_with(self, *argv: str) -> Iterator[None]:
        """The gateway restarted with ``argv`` added (a later flag wins), then as it was."""
        normal = self.specs["gateway"]
        self.specs["gateway"] = replace(normal, argv=(*normal.argv, *argv))
        try:
            self.running["gateway"].stop()
            self.start("gateway")
            yield
        finally:
            self.specs["gateway"] = normal
            self.running["gateway"].stop()
            self.start("gateway")

    def gateway_counter(self, name: str) -> float:
        """A gateway counter summed over its labels."""
        metrics = httpx.get(f"{self.base_url}/metrics", timeout=2).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith((f"{name}{{", f"{name} "))
        )

    def pid(self, name: str) -> int:
        return self.running[name].children[0].pid

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        os.kill(self.pid(name), sig)
        if sig == signal.SIGKILL:
            self.running[name].children[0].process.wait(10)

    def restart_dead(self) -> None:
        for name, supervisor in list(self.running.items()):
            if not supervisor.children[0].is_alive:
                supervisor.stop()
                self.start(name)
        # The gateway needs a poll to see restarted nodes as healthy again.
        self.wait_gateway_ready()

    def wait_gateway_ready(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                ready = httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200
                if ready and self._every_node_healthy_in_gateway():
                    return
            time.sleep(0.2)
        raise AssertionError("the gateway never saw every node healthy again")

    def _every_node_healthy_in_gateway(self) -> bool:
        metrics = httpx.get(f"{self.base_url}/metrics", timeout=2).text
        healthy = 0
        for line in metrics.splitlines():
            if line.startswith("pdserve:healthy_nodes{"):
                healthy += int(float(line.rsplit(" ", 1)[1]))
        return healthy == len(self.node_names)

    @property
    def node_names(self) -> list[str]:
        return [n.name for n in self.topology.nodes]

    def blocks_in_use(self) -> dict[str, int]:
        async def load() -> dict[str, int]:
            used = {}
            for name in self.node_names:
                if not self.running[name].children[0].is_alive:
                    continue
                async with grpc.aio.insecure_channel(self.address(name)) as channel:
                    stub = (
                        prefill_pb2_grpc.PrefillServiceStub(channel)
                        if name.startswith("prefill")
                        else decode_pb2_grpc.DecodeServiceStub(channel)
                    )
                    report = await stub.GetLoad(common_pb2.GetLoadRequest(), timeout=5)
                    used[name] = report.kv_blocks_used
            return used

        return asyncio.run(load())

    def wait_all_free(self, timeout_s: float = 15) -> None:
        deadline = time.monotonic() + timeout_s
        while (used := self.blocks_in_use()) and any(used.values()):
            assert time.monotonic() < deadline, f"blocks still in use: {used}"
            time.sleep(0.1)

    def stop(self) -> None:
        for name in ["gateway", *self.node_names]:
            if name in self.running:
                self.running[name].stop()

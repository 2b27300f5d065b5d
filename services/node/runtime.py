"""Runs one node process: engine, engine thread, gRPC server, drain on SIGTERM, exit 0.

Life cycle: load the engine (the slow part, before the port opens, so health never says
SERVING for a node that cannot serve; a flag value or model file it refuses ends the process with
a one-line error, exit 2 or 1; any other error out of it is a bug, and keeps its traceback) →
start the engine thread → open the gRPC and metrics ports (a taken one ends the process with
exit code 1 and a one-line error) → start the server → serve until SIGTERM/SIGINT → drain (see
``NodeServer``) → stop the engine thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from kv_transfer.memory import MemoryKind, UnsupportedMemoryError
from kv_transfer.transport_choice import choose_transport
from pdserve.v1 import common_pb2
from services.async_engine import AsyncEngine, EngineDeadError
from services.convert import load_report_to_proto
from services.engine import EngineCore
from services.host_memory import heap_on_huge_pages
from services.listen import ListenError
from services.models import ModelFileError
from services.models.native_build import UnsupportedIsaError
from services.node.config import NodeConfig, name_flags
from services.node.grpc_server import NodeServer, Registrar
from services.node.metrics import NodeMetrics
from services.types import EngineConfigError, Role

logger = logging.getLogger(__name__)


class EngineRefusedError(Exception):
    """The engine could not be built as configured: a one-line message naming the flag or the
    file, and the exit code (2: a flag's value, like argparse; 1: a file or this machine)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    @classmethod
    def from_error(cls, exc: EngineConfigError | ModelFileError | OSError) -> EngineRefusedError:
        if isinstance(exc, ModelFileError):
            return cls(f"--model: {exc}", 1)
        if isinstance(exc, OSError):
            return cls(str(exc), 1)
        return cls(name_flags(str(exc)), 2)


@dataclass(frozen=True)
class NodeServices:
    """What a role contributes: its service names and how to register its servicers."""

    service_names: Sequence[str]
    registrars: Sequence[Registrar]


# Given the node's config, its engine, its server (for admit/draining) and its metrics, a role
# returns the services it serves.
RoleFactory = Callable[[NodeConfig, AsyncEngine, "NodeServerRef", NodeMetrics], NodeServices]


class NodeServerRef:
    """Lets servicers built before the server reach it once it exists (admit, draining)."""

    def __init__(self) -> None:
        self.server: NodeServer | None = None

    def get(self) -> NodeServer:
        assert self.server is not None, "servicer used before the server was built"
        return self.server


async def load_report(
    config: NodeConfig,
    engine: AsyncEngine,
    server: NodeServerRef,
    context: grpc.aio.ServicerContext[common_pb2.GetLoadRequest, common_pb2.LoadReport],
) -> common_pb2.LoadReport:
    """GetLoad for every role: the engine's stats as the router reads them — the last step's
    snapshot, never waiting for the step in progress (the gateway's poll has a deadline)."""
    try:
        stats = engine.stats
    except EngineDeadError as exc:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    return load_report_to_proto(
        stats,
        node_id=config.node_id,
        role=str(config.role),
        fingerprint=engine.engine.kv_layout.fingerprint,
        draining=server.get().is_draining,
        lora_names=stats.lora_names,
    )


async def start_node(config: NodeConfig, role: RoleFactory) -> tuple[NodeServer, AsyncEngine]:
    # Built on the engine thread: that thread must be the only one to run torch ops (see
    # services/async_engine.py). Blocks this loop while the model loads, before the port opens.
    engine = AsyncEngine(
        lambda: EngineCore(config.engine),
        test_step_delay_s=config.test_step_delay_s,
        test_step_slowdown=config.test_step_slowdown,
    )
    try:
        engine.start()
    except (EngineConfigError, ModelFileError, OSError) as exc:
        # The engine's errors for its inputs: EngineConfigError for a setting or a model it
        # cannot run with, ModelFileError for a file it cannot parse, OSError for one it cannot
        # open. Anything else, a ValueError included, is a bug and keeps its traceback;
        # UnsupportedIsaError names its own setting (PDSERVE_NATIVE_ISA) and exits in run().
        raise EngineRefusedError.from_error(exc) from exc
    config = resolve_kv_transport(config)
    ref = NodeServerRef()
    metrics = NodeMetrics(str(config.role), config.node_id, config.kv_transport)
    try:
        services = role(config, engine, ref, metrics)
    except UnsupportedMemoryError:
        engine.shutdown()
        raise
    choice = engine.engine.dtype_choice
    metrics.compute_dtype(choice.dtype, choice.source, choice.gflops)
    kv_choice = engine.engine.kv_dtype_choice
    metrics.kv_cache_dtype(kv_choice.dtype, kv_choice.reason)
    try:
        # Both ports are opened before the server starts serving.
        server = NodeServer(
            config.grpc_address,
            services.service_names,
            services.registrars,
            drain_grace_s=config.drain_grace_s,
            tls=config.tls,
        )
        if config.metrics_port is not None:
            metrics.serve(config.metrics_port)
    except ListenError:
        engine.shutdown()
        raise
    ref.server = server
    await server.start()
    # Held by the server object so it lives as long as the node.
    server.background_tasks.append(asyncio.ensure_future(metrics.refresh_forever(engine)))
    return server, engine


def resolve_kv_transport(config: NodeConfig) -> NodeConfig:
    """`--kv-transport auto` becomes the transport it picks (logged with why), so every later
    use, the metric labels included, names the transport actually in use."""
    if config.role is Role.COLOCATED:
        return config  # no KV handoff between processes
    memory = MemoryKind.CUDA if config.engine.device.startswith("cuda") else MemoryKind.HOST
    name, why = choose_transport(config.kv_transport, memory, config.kv_scope)
    logger.info("KV transport %s: %s", name, why)
    return dataclasses.replace(config, kv_transport=name)


async def serve(config: NodeConfig, role: RoleFactory) -> None:
    server, engine = await start_node(config, role)
    server.install_signal_handlers()
    logger.info("%s node %s ready on port %d", config.role, config.node_id, server.port)
    try:
        await server.wait()
    finally:
        engine.shutdown()
    logger.info("%s node %s stopped", config.role, config.node_id)


def run(config: NodeConfig, role: RoleFactory) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logger.info(
        "glibc heap on transparent huge pages: %s (GLIBC_TUNABLES=%r)",
        "yes" if heap_on_huge_pages() else "no",
        os.environ.get("GLIBC_TUNABLES", ""),
    )
    try:
        asyncio.run(serve(config, role))
    # Start-up refusals a user can act on: one line, exit 1, no traceback.
    except (ListenError, UnsupportedMemoryError, UnsupportedIsaError) as exc:
        logger.error("%s", exc)
        raise SystemExit(1) from None
    except EngineRefusedError as exc:
        logger.error("%s", exc)
        raise SystemExit(exc.exit_code) from None

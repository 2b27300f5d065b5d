"""A node's gRPC server: its services plus grpc.health.v1 and reflection, with graceful drain.

Life cycle (``NodeServer``):

1. ``start()``      binds the port, marks every service ``SERVING``.
2. serving          servicers wrap each request in ``admit(context)``, which counts it in flight.
3. ``drain()``      (SIGTERM) health goes ``NOT_SERVING`` at once, so load balancers and the
                    router stop sending; new requests get ``UNAVAILABLE``; requests in flight
                    get ``drain_grace_s`` to finish; then the server stops and ``wait()``
                    returns, and the process exits 0.

Health reports this process's own state, never its peers': a dead prefill node must not make a
healthy decode node fail its health check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from services.listen import add_grpc_port
from services.malformed_requests import RejectMalformedRequests
from services.tls import TlsFiles, server_credentials

logger = logging.getLogger(__name__)

Registrar = Callable[[grpc.aio.Server], None]


class NodeServer:
    def __init__(
        self,
        address: str,
        service_names: Sequence[str],
        registrars: Sequence[Registrar],
        *,
        drain_grace_s: float,
        tls: TlsFiles | None = None,
    ) -> None:
        """``service_names``: full names (``pdserve.v1.DecodeService``) for health and
        reflection; ``registrars`` add the servicers (``add_XServicer_to_server``). With
        ``tls`` the port is mutual TLS: every client (health probes too) must present a
        certificate from the deployment CA."""
        self.address = address
        self.service_names = list(service_names)
        self.drain_grace_s = drain_grace_s
        self.server = grpc.aio.server(interceptors=[RejectMalformedRequests()])
        for register in registrars:
            register(self.server)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME],
            self.server,
        )  # fmt: skip
        credentials = None if tls is None else server_credentials(tls)
        self.port = add_grpc_port(self.server, address, "gRPC", credentials)
        self._draining = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._stopped = asyncio.Event()
        self.background_tasks: list[asyncio.Task[None]] = []
        """Node-lifetime tasks (metrics refresh, reapers); cancelled when the server stops."""

    @property
    def is_draining(self) -> bool:
        return self._draining

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    async def start(self) -> None:
        await self.server.start()
        for name in ["", *self.service_names]:  # "" is the whole server
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        logger.info("serving %s on port %d", ", ".join(self.service_names), self.port)

    @contextlib.asynccontextmanager
    async def admit(self, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[None]:
        """Count a request in flight for as long as the block runs; refuse it while draining."""
        if self._draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "node is draining (shutting down)")
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def drain(self) -> None:
        """NOT_SERVING, refuse new work, let in-flight requests finish (up to the grace), stop."""
        if self._draining:
            return
        self._draining = True
        logger.info(
            "draining: %d requests in flight, grace %.1fs", self._in_flight, self.drain_grace_s
        )
        await self.health.enter_graceful_shutdown()  # every service NOT_SERVING
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=self.drain_grace_s)
        except TimeoutError:
            logger.warning(
                "drain grace over with %d requests in flight: cancelling them", self._in_flight
            )
        await self.server.stop(grace=0)
        for task in self.background_tasks:
            task.cancel()
        self._stopped.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.drain()))

    async def wait(self) -> None:
        """Until ``drain`` has stopped the server."""
        await self._stopped.wait()

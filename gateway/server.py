"""Starts and stops a gateway: the node pool's health loop, the public gRPC server and the
OpenAI HTTP server, all on one asyncio loop.

Life cycle: ``GatewayServer.start`` (tokenizer loaded, node channels opened, poll loop started,
both ports bound — port 0 picks a free one, for tests) → serving; grpc.health.v1 says SERVING
and ``/health`` 200 only while a pair or a colocated node is healthy → ``stop(grace_s)``: health
NOT_SERVING, no new requests, open streams get ``grace_s`` to finish, then channels close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.admission import TOKENIZER_SLOTS, Admission
from gateway.auth import ApiKeys
from gateway.config import GatewayConfig
from gateway.frontend import Frontend
from gateway.grpc_api import GatewayServicer
from gateway.http_api.openai_app import build_openai_app
from gateway.key_limiter import KeyLimiter, KeyMeteredGenerator
from gateway.metrics import GatewayMetrics
from gateway.routing.lora_updates import LoraUpdates
from gateway.routing.node_pool import NodePool
from gateway.routing.routed_embedder import RoutedEmbedder
from gateway.routing.routed_generator import RoutedGenerator
from gateway.routing.router import Router
from gateway.text.tokenizer import Tokenizer
from pdserve.v1 import gateway_pb2, gateway_pb2_grpc
from services.listen import add_grpc_port, bind_tcp
from services.malformed_requests import RejectMalformedRequests
from services.tls import edge_server_credentials
from services.types import Role

logger = logging.getLogger(__name__)

_API_METHOD_PREFIX = f"/{gateway_pb2.DESCRIPTOR.services_by_name['GatewayService'].full_name}/"


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside our loop: the gateway's entry point owns SIGTERM/SIGINT, not uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class GatewayServer:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.metrics = GatewayMetrics()
        self.pool = NodePool(
            config.router.prefill,
            config.router.decode,
            config.router.colocated,
            interval_s=config.router.health_interval_s,
            timeout_s=config.router.health_timeout_s,
            tls=config.tls,
        )
        self.router = Router(self.pool, config.router)
        self.lora_updates = (
            LoraUpdates(self.pool, prefill_grace_ms=config.router.lease_ms)
            if config.allow_runtime_lora_updating
            else None
        )
        routed = RoutedGenerator(self.router, config.router, self.metrics)
        self.admission = Admission(config.max_concurrent_requests, config.max_queued_requests)
        self.frontend = Frontend(
            served_model_name=config.served_model_name,
            tokenizer=Tokenizer.from_model_dir(config.model_dir, config.chat_template),
            # Charges each request's API key for its tokens (per-key limits).
            generator=KeyMeteredGenerator(routed),
            admission=self.admission,
            tokenizer_admission=Admission(TOKENIZER_SLOTS, config.max_queued_requests),
            api_keys=ApiKeys(config.api_keys),
            limits=config.limits,
            metrics=self.metrics,
            node_census=self.pool.census,
            request_timeout_s=config.request_timeout_s,
            client_send_timeout_s=config.client_send_timeout_s,
            key_limiter=KeyLimiter(self.metrics.registry),
            reasoning_parser=config.reasoning_parser,
            tool_call_parser=config.tool_call_parser,
            sampling_defaults=config.sampling_defaults,
            served_model_aliases=config.served_model_aliases,
            lora_modules=config.lora_modules,
            node_lora_names=self.pool.lora_names,
            embedder=RoutedEmbedder(self.router, config.router),
            lora_updates=self.lora_updates,
            responses_store_size=config.responses_store_size,
        )
        if config.sampling_defaults.as_dict():
            logger.info(
                "sampling defaults from the model's generation config (requests that leave "
                "them unset): %s",
                config.sampling_defaults.as_dict(),
            )
        self.health = health.aio.HealthServicer()
        self.http_port = 0
        self.grpc_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._http: _EmbeddedUvicorn | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._restores: set[asyncio.Task[list[str]]] = set()
        """``LoraUpdates.restore`` of nodes back from UNHEALTHY, off the health loop (a load
        may take seconds)."""

    async def start(self) -> None:
        config = self.config
        await self.pool.poll_once()
        self._tasks.append(asyncio.create_task(self._watch_health(), name="gateway-health"))

        self._grpc = grpc.aio.server(
            interceptors=[RejectMalformedRequests(on_refused=self._count_malformed)]
        )
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(
            GatewayServicer(self.frontend), self._grpc
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        reflection.enable_server_reflection(
            (
                gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self._grpc,
        )
        # Both ports are taken before either server starts: a taken one ends start() with a
        # ListenError and nothing left running.
        public_credentials = (
            None if config.public_tls is None else edge_server_credentials(config.public_tls)
        )
        self.grpc_port = add_grpc_port(
            self._grpc, f"{config.host}:{config.grpc_port}", "the gRPC API", public_credentials
        )
        sock = bind_tcp(config.host, config.http_port, "the HTTP API")
        self.http_port = sock.getsockname()[1]
        await self._grpc.start()
        ssl_certfile, ssl_keyfile = self._http_tls()
        self._http = _EmbeddedUvicorn(
            uvicorn.Config(
                build_openai_app(self.frontend, config.cors),
                log_level=config.log_level,
                access_log=False,
                # SSE streams idle between tokens of a slow model; keep-alive must outlast that.
                timeout_keep_alive=30,
                timeout_graceful_shutdown=30,
                ssl_certfile=ssl_certfile,
                ssl_keyfile=ssl_keyfile,
            )
        )
        self._tasks.append(asyncio.create_task(self._http.serve(sockets=[sock]), name="http"))
        while not self._http.started:
            if self._tasks[-1].done():
                self._tasks[-1].result()  # raises what stopped uvicorn
            await asyncio.sleep(0.01)
        logger.info(
            "gateway serving %s: HTTP%s on %s:%d, gRPC%s on %s:%d; mutual TLS to nodes: %s",
            config.served_model_name, "S" if config.public_tls else "", config.host,
            self.http_port, " (TLS)" if config.public_tls else "", config.host, self.grpc_port,
            "on" if config.tls else "off",
        )  # fmt: skip

    def _count_malformed(self, method: str) -> None:
        """A call whose bytes did not parse never reaches the servicer, which counts the rest:
        one to the API counts as an HTTP body that is not JSON does. Health and reflection
        calls are not API requests: no metric counts them."""
        if method.startswith(_API_METHOD_PREFIX):
            self.metrics.request_errors.labels(reason="invalid_argument").inc()

    def _http_tls(self) -> tuple[str | None, str | None]:
        """uvicorn's ``ssl_certfile`` and ``ssl_keyfile`` (None: plain HTTP)."""
        tls = self.config.public_tls
        if tls is None:
            return None, None
        return str(tls.cert), str(tls.key)

    async def _watch_health(self) -> None:
        """Polls the nodes and mirrors readiness into grpc.health.v1 and the healthy-node gauges.

        NOTE: the request gauges are not set here: the HTTP app reads them from ``Admission`` at
        scrape time (``build_openai_app``).
        """
        while True:
            census = self.pool.census()
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if census.is_ready
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            await self.health.set("", status)
            await self.health.set("pdserve.v1.GatewayService", status)
            for role in Role:
                self.metrics.healthy_nodes.labels(role=str(role)).set(census.role(role).num_healthy)
            await asyncio.sleep(self.pool.interval_s)
            for node in await self.pool.poll_once():
                self.router.forget(node)  # soft state: a restarted node's cache is empty
                if self.lora_updates is not None:  # and it has only its --lora-modules
                    task = asyncio.create_task(self.lora_updates.restore(node))
                    self._restores.add(task)
                    task.add_done_callback(self._restore_done)

    def _restore_done(self, task: asyncio.Task[list[str]]) -> None:
        self._restores.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("restoring a node's LoRA adapters failed", exc_info=task.exception())

    async def stop(self, grace_s: float = 30.0) -> None:
        await self.health.enter_graceful_shutdown()
        if self._http is not None:
            # uvicorn annotates it int but only hands it to asyncio.wait_for, which takes a float.
            self._http.config.timeout_graceful_shutdown = grace_s  # type: ignore[assignment]
            self._http.should_exit = True
        if self._grpc is not None:
            await self._grpc.stop(grace_s)
        for restore in list(self._restores):
            restore.cancel()
        for task in self._tasks:
            if task.get_name() == "http":
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(task, grace_s + 1)
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.pool.close()

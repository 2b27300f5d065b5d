"""Run-time LoRA updates over every node the gateway routes to: vLLM's ``/v1/load_lora_adapter``
and ``/v1/unload_lora_adapter``, behind ``--allow-runtime-lora-updating``.

Life cycle of a load: every healthy node (draining ones are leaving) gets LoadLoraAdapter at
once. When each loaded it, or had those files under the name already, each node's adapters are
updated here at once (``Node.set_lora_names``), so a request sent after the answer routes to
them without waiting for the next poll. When any node refused (files it cannot read or apply,
``max_loras`` reached, LoRA off, the name loaded from other files) or did not answer, the nodes
this call loaded it on unload it again and the refusal, naming the node, is the answer: the
nodes end as they began. Where every node had it already the answer is vLLM's 400.

An unload goes to the same nodes. Each stops taking new requests of the adapter at once and
drops it when the requests running with it end; a prefill node keeps it for the reservation
lease besides, for the requests a decode node reserved before the unload and whose prompts are
on their way. A node that does not have it is no error unless none has (404). Neither call
can undo what a node did after it answered, so a node that failed is named, and those that
unloaded it stay so.

Nodes the gateway does not see healthy are skipped and named in the answer. A node keeps only
its ``--lora-modules`` across a restart, so a node that comes back lacks the adapters loaded at
run time, and is not routed their requests meanwhile (the load reports say which adapters each
node has); so does a node new to the gateway (a replica added). ``restore`` mends that: for a
node that turns HEALTHY (new, restarted, or one a load skipped), it loads each adapter loaded
through this gateway that the node lacks and another healthy node still has, from the same
path. An adapter no healthy node has any more (unloaded meanwhile, here or through another
gateway) is not brought back. What a gateway loaded is its own memory: a restarted gateway, or
another replica, restores none of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from gateway.errors import ErrorKind, GatewayError
from gateway.routing.node import Node
from gateway.routing.node_pool import NodePool
from services.types import Role

logger = logging.getLogger(__name__)

# How long one node may take to load an adapter: its files are read and its weights placed on
# the node's engine thread; a slow disk or a loaded host must not turn that into a failure.
UPDATE_TIMEOUT_S = 300.0


class LoraUpdates:
    def __init__(
        self, pool: NodePool, timeout_s: float = UPDATE_TIMEOUT_S, prefill_grace_ms: int = 0
    ) -> None:
        """``prefill_grace_ms``: how long prefill nodes keep an unloaded adapter for requests
        already reserved on a decode node (the gateway's reservation lease, ``--lease-ms``,
        bounds how long such a request takes to reach its prefill node)."""
        self._pool = pool
        self._timeout_s = timeout_s
        self._prefill_grace_ms = prefill_grace_ms
        self._lock = asyncio.Lock()
        """One update at a time: a load's roll-back must not undo another call's load."""
        self._loaded: dict[str, str] = {}
        """Adapter name -> path of each load this gateway made, until its unload: what
        ``restore`` gives a node that lacks it."""

    async def load(self, name: str, path: str) -> str:
        """Load adapter ``name`` from ``path`` (as the nodes' hosts see it) on every healthy
        node; vLLM's success text, or ``GatewayError``."""
        async with self._lock:
            nodes, skipped = self._targets()
            results = await asyncio.gather(
                *(
                    self._pool.client(node).load_lora_adapter(name, path, self._timeout_s)
                    for node in nodes
                ),
                return_exceptions=True,
            )
            loaded = [node for node, result in zip(nodes, results, strict=True) if result is True]
            failed = [
                (node, result)
                for node, result in zip(nodes, results, strict=True)
                if isinstance(result, BaseException)
            ]
            if failed:
                await self._roll_back(name, loaded)
                raise _refusal(*failed[0])
            for node in nodes:
                node.set_lora_names(_names(node) | {name})
            if not loaded:
                raise GatewayError(
                    ErrorKind.INVALID_ARGUMENT,
                    f"The lora adapter '{name}' has already been loaded.",
                    param="lora_name",
                )
            self._loaded[name] = path
            logger.info("LoRA adapter %r loaded from %s on %d nodes", name, path, len(loaded))
            return f"Success: LoRA adapter '{name}' added successfully." + _skipped(skipped)

    async def unload(self, name: str) -> str:
        """Unload adapter ``name`` from every healthy node; vLLM's success text, or
        ``GatewayError`` (404 where no node has it)."""
        async with self._lock:
            nodes, skipped = self._targets()
            results = await asyncio.gather(
                *(self._pool.client(node).unload_lora_adapter(name, self._timeout_s,
                                                              self._grace_ms(node))
                  for node in nodes),
                return_exceptions=True,
            )  # fmt: skip
            self._loaded.pop(name, None)  # asked to go: never restored, whatever the nodes say
            unloaded: list[Node] = []
            failed: list[tuple[Node, BaseException]] = []
            for node, result in zip(nodes, results, strict=True):
                if not isinstance(result, BaseException):
                    unloaded.append(node)
                elif not _is_not_found(result):
                    failed.append((node, result))
                if not isinstance(result, BaseException) or _is_not_found(result):
                    node.set_lora_names(_names(node) - {name})
            if failed:
                done = ", ".join(node.address for node in unloaded) or "none"
                error = _refusal(*failed[0])
                raise GatewayError(ErrorKind.UNAVAILABLE, f"{error.message} (unloaded on: {done})")
            if not unloaded:
                raise GatewayError(
                    ErrorKind.NOT_FOUND,
                    f"The lora adapter '{name}' cannot be found.",
                    param="lora_name",
                )
            logger.info("LoRA adapter %r unloaded on %d nodes", name, len(unloaded))
            return f"Success: LoRA adapter '{name}' removed successfully." + _skipped(skipped)

    async def restore(self, node: Node) -> list[str]:
        """Load on ``node`` (just HEALTHY: new, or maybe restarted) each adapter loaded through
        this gateway that it lacks and another healthy node has; returns their names. A refusal
        is logged and the node left without that adapter (its reports keep its requests away)."""
        async with self._lock:
            if not node.is_healthy:
                return []
            others = [other for other in self._pool.nodes if other is not node and other.is_healthy]
            missing = [
                (name, path)
                for name, path in sorted(self._loaded.items())
                if name not in _names(node) and any(name in _names(other) for other in others)
            ]
            restored = []
            for name, path in missing:
                try:
                    await self._pool.client(node).load_lora_adapter(name, path, self._timeout_s)
                except grpc.aio.AioRpcError as exc:
                    logger.warning("node %s (%s) did not take LoRA adapter %r back from %s: %s: %s",
                                   node.address, node.role, name, path, exc.code().name,
                                   exc.details())  # fmt: skip
                    continue
                node.set_lora_names(_names(node) | {name})
                restored.append(name)
            if restored:
                logger.info("node %s (%s): LoRA adapters %s loaded again", node.address,
                            node.role, ", ".join(restored))  # fmt: skip
            return restored

    def _grace_ms(self, node: Node) -> int:
        return self._prefill_grace_ms if node.role is Role.PREFILL else 0

    def _targets(self) -> tuple[list[Node], list[Node]]:
        """The nodes an update goes to (healthy), and those it skips."""
        nodes = self._pool.nodes
        healthy = [node for node in nodes if node.is_healthy]
        if not healthy:
            raise GatewayError(ErrorKind.UNAVAILABLE, "no healthy node to update")
        return healthy, [node for node in nodes if not node.is_healthy]

    async def _roll_back(self, name: str, nodes: Sequence[Node]) -> None:
        results = await asyncio.gather(
            *(self._pool.client(node).unload_lora_adapter(name, self._timeout_s)
              for node in nodes),
            return_exceptions=True,
        )  # fmt: skip
        for node, result in zip(nodes, results, strict=True):
            if isinstance(result, BaseException):
                logger.warning("node %s keeps LoRA adapter %r: its roll-back failed: %r",
                               node.address, name, result)  # fmt: skip


def _names(node: Node) -> frozenset[str]:
    return node.load.lora_names or frozenset()


def _is_not_found(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() is grpc.StatusCode.NOT_FOUND


def _refusal(node: Node, exc: BaseException) -> GatewayError:
    """A node's refusal as the client's error: the node's own words for what the request got
    wrong (400, naming the field), else 503."""
    if not isinstance(exc, grpc.aio.AioRpcError):
        raise exc  # a bug here, not the node's answer
    details = exc.details() or ""
    where = f"node {node.address} ({node.role})"
    if exc.code() in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    ):
        field, _, _ = details.partition(":")
        param = field if field in ("lora_name", "lora_path") else None
        return GatewayError(ErrorKind.INVALID_ARGUMENT, f"{where}: {details}", param=param)
    return GatewayError(ErrorKind.UNAVAILABLE, f"{where}: {exc.code().name}: {details}")


def _skipped(nodes: Sequence[Node]) -> str:
    if not nodes:
        return ""
    return (
        f" Not sent to {len(nodes)} node(s) not healthy now "
        f"({', '.join(node.address for node in nodes)}): this gateway loads it on them when "
        "they serve again."
    )

"""Picks the nodes for one attempt of one request: a (prefill, decode) pair, or a colocated node.

- **Decode by load**: the healthy decode node with the least work, where work is the larger of
  the gateway's own in-flight count and the node's last reported running + waiting + reserved,
  plus a penalty that grows with KV usage (a nearly full cache will refuse reservations).
- **Prefill by queue depth plus prefix affinity**: the node that was last sent the longest
  prefix of this prompt, while its queue is at most ``affinity_max_imbalance`` deeper than the
  shortest; otherwise the shortest queue. Requests sharing a system prompt therefore land on
  the prefill node whose prefix cache holds it.
- **Short prompts stay on the decode node** (conditional disaggregation, as in NVIDIA Dynamo):
  a prompt of at most ``local_prefill_max_tokens`` tokens is prefilled by the decode node
  itself. Its prefill adds a small chunk to one decode step, where on a prefill node it would
  queue behind long prompts and then pay the reservation, push and commit.
- **Colocated nodes** serve when no pair is available (none configured, none healthy, or all
  already tried by this request).

Nodes named in ``exclude`` (tried and failed by this request) are skipped; the router never
blocks and never retries by itself.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from gateway.config import RouterConfig
from gateway.routing.node import Node
from gateway.routing.node_pool import NodePool
from gateway.routing.prefix_affinity import BASE, Namespace, PrefixAffinity
from services.types import Role

logger = logging.getLogger(__name__)

# Work units added at 100 % KV usage: a full decode node ranks behind one with this many more
# requests but free blocks.
_KV_USAGE_PENALTY = 32


@dataclass(frozen=True)
class Route:
    decode: Node
    """Generates; it also computes the prompt when ``prefill`` is None."""
    prefill: Node | None

    @property
    def kind(self) -> str:
        """The metric label: ``disaggregated``, ``local_prefill`` or ``colocated``."""
        if self.prefill is not None:
            return "disaggregated"
        return "local_prefill" if self.decode.role is Role.DECODE else "colocated"


def _prefill_queue(node: Node) -> int:
    return max(node.num_in_flight, node.load.num_running + node.load.num_waiting)


def _decode_work(node: Node) -> float:
    reported = node.load.num_running + node.load.num_waiting + node.load.num_reserved
    return max(node.num_in_flight, reported) + _KV_USAGE_PENALTY * node.load.kv_usage


class Router:
    def __init__(self, pool: NodePool, config: RouterConfig) -> None:
        self.pool = pool
        self.config = config
        self.affinity = PrefixAffinity(config.affinity_block_size)

    def pick(
        self,
        prompt: Sequence[int],
        exclude: Collection[str] = (),
        namespace: Namespace = BASE,
    ) -> Route | None:
        """A route for ``prompt`` (its ``namespace`` keys prefix affinity, as the nodes' prefix
        caches) over nodes that loaded its LoRA adapter, avoiding the nodes in ``exclude``;
        None where none is healthy."""
        lora = namespace[1]

        def usable(nodes: list[Node]) -> list[Node]:
            return [
                n
                for n in nodes
                if n.is_healthy and n.address not in exclude and n.load.serves(lora)
            ]

        decodes, prefills = usable(self.pool.decode), usable(self.pool.prefill)
        if decodes and len(prompt) <= self.config.local_prefill_max_tokens:
            # Needs no prefill node: served even while none is healthy.
            return Route(decode=min(decodes, key=_decode_work), prefill=None)
        if decodes and prefills:
            decode = min(decodes, key=_decode_work)
            prefill = self.pick_prefill(prompt, prefills, namespace)
            self.affinity.record(prompt, prefill.address, namespace)
            return Route(decode=decode, prefill=prefill)
        colocated = usable(self.pool.colocated)
        if colocated:
            return Route(decode=min(colocated, key=_decode_work), prefill=None)
        return None

    def why_none(self, prompt: Sequence[int], lora_name: str | None = None) -> str:
        """Why ``pick`` finds no route for ``prompt`` of adapter ``lora_name`` now (the nodes a
        request tried aside): what a client's 503 names first."""

        def any_healthy(nodes: list[Node]) -> bool:
            return any(n.is_healthy for n in nodes)

        if lora_name is not None:
            lacking = [
                str(role)
                for role, nodes in (
                    ("prefill", self.pool.prefill),
                    ("decode", self.pool.decode),
                    ("colocated", self.pool.colocated),
                )
                if any_healthy(nodes)
                and not any(n.is_healthy and n.load.serves(lora_name) for n in nodes)
            ]
            if lacking:
                return (
                    f"no healthy {' or '.join(lacking)} node has loaded LoRA adapter "
                    f"{lora_name!r} (their --lora-modules, or a run-time load)"
                )
        causes = []
        if self.config.decode:
            missing = []
            needs_prefill = len(prompt) > self.config.local_prefill_max_tokens
            if needs_prefill and not any_healthy(self.pool.prefill):
                missing.append("prefill")
            if not any_healthy(self.pool.decode):
                missing.append("decode")
            if missing:
                causes.append(f"no healthy {' or '.join(missing)} node")
            elif needs_prefill:
                causes.append("this request tried every healthy prefill/decode pair")
            else:
                causes.append("this request tried every healthy decode node")
        if self.config.colocated:
            if any_healthy(self.pool.colocated):
                causes.append("this request tried every healthy colocated node")
            else:
                causes.append("no healthy colocated node")
        return "; ".join(causes)

    def pick_embedder(
        self, prompt: Sequence[int], exclude: Collection[str] = (), lora_name: str | None = None
    ) -> Node | None:
        """A node to compute ``prompt``'s embedding (with adapter ``lora_name``): a prefill or
        colocated node, by prefix affinity and queue length; a decode node (it computes short
        prompts itself) only where neither is healthy; None where no node is."""

        def usable(nodes: list[Node]) -> list[Node]:
            return [
                n
                for n in nodes
                if n.is_healthy and n.address not in exclude and n.load.serves(lora_name)
            ]

        namespace: Namespace = (None, lora_name)
        computing = usable(self.pool.prefill) + usable(self.pool.colocated)
        if computing:
            node = self.pick_prefill(prompt, computing, namespace)
            self.affinity.record(prompt, node.address, namespace)
            return node
        decodes = usable(self.pool.decode)
        return min(decodes, key=_decode_work) if decodes else None

    def forget(self, node: Node) -> None:
        """A node came back (perhaps restarted, its prefix cache empty): its affinity goes."""
        self.affinity.forget(node.address)

    def pick_prefill(
        self, prompt: Sequence[int], candidates: list[Node], namespace: Namespace = BASE
    ) -> Node:
        shortest = min(_prefill_queue(n) for n in candidates)
        matches = self.affinity.matched_tokens(prompt, namespace)
        affine = [
            n
            for n in candidates
            if matches.get(n.address, 0) > 0
            and _prefill_queue(n) <= shortest + self.config.affinity_max_imbalance
        ]
        if affine:
            return max(affine, key=lambda n: (matches[n.address], -_prefill_queue(n)))
        return min(candidates, key=_prefill_queue)

"""Picks the nodes for one attempt of one request: a (prefill, decode) pair, a prefill node
alone, or a colocated node.

- **Decode by load plus prefix affinity**: the healthy decode node with the least work, where
  work is the larger of the gateway's own in-flight count and the node's last reported running
  + waiting + reserved, plus a penalty that grows with KV usage (a nearly full cache will refuse
  reservations); but the node that was last sent the longest prefix of this prompt while its
  work is at most ``affinity_max_imbalance`` above the least. A decode node's reservation takes
  a prefix its cache holds instead of having it pushed and held again (a chat's earlier turns,
  a system prompt), so a conversation stays on its node. Colocated nodes are chosen so too.
- **Prefill by queue depth plus prefix affinity**: the node that was last sent the longest
  prefix of this prompt, while its queue is at most ``affinity_max_imbalance`` deeper than the
  shortest; otherwise the shortest queue. Requests sharing a system prompt therefore land on
  the prefill node whose prefix cache holds it.
- **Short prompts stay on the decode node** (conditional disaggregation, as in NVIDIA Dynamo):
  a prompt of at most ``local_prefill_max_tokens`` tokens is prefilled by the decode node
  itself. Its prefill adds a small chunk to one decode step, where on a prefill node it would
  queue behind long prompts and then pay the reservation, push and commit.
- **A first token that is the last goes no further than the prefill node** (``first_token_ends``:
  ``max_tokens=1``, as a beam search round's or a scoring request's): the prefill node samples
  the first token in every disaggregated route, so a decode node would only reserve blocks,
  take the pushed pages and free them unread. Such a request goes to a prefill node alone
  (chosen as above), and is served even while no decode node is healthy.
- **Colocated nodes** serve when no pair is available (none configured, none healthy, or all
  already tried by this request).

Nodes named in ``exclude`` (tried and failed by this request) are skipped; the router never
blocks and never retries by itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
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
    decode: Node | None
    """Generates; it also computes the prompt when ``prefill`` is None. None: the prefill node's
    first token ends the request, no decode node takes part."""
    prefill: Node | None

    def __post_init__(self) -> None:
        assert self.decode is not None or self.prefill is not None, "a route needs a node"

    @property
    def kind(self) -> str:
        """The metric label: ``disaggregated``, ``prefill_only``, ``local_prefill`` or
        ``colocated``."""
        if self.decode is None:
            return "prefill_only"
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
        """Which node that computes prompts (prefill, or colocated for embeddings) last saw each
        prefix."""
        self.decode_affinity = PrefixAffinity(config.affinity_block_size)
        """Which node that generates (decode or colocated) was last given each prefix: its
        prefix cache holds the prompt (and what it generated) once the request ends."""

    def pick(
        self,
        prompt: Sequence[int],
        exclude: Collection[str] = (),
        namespace: Namespace = BASE,
        first_token_ends: bool = False,
    ) -> Route | None:
        """A route for ``prompt`` (its ``namespace`` keys prefix affinity, as the nodes' prefix
        caches) over nodes that loaded its LoRA adapter, avoiding the nodes in ``exclude``;
        None where none is healthy. ``first_token_ends``: the request ends at its first token
        (``max_tokens=1``), which a prefill node serves alone."""
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
            return Route(decode=self._pick_decode(prompt, decodes, namespace), prefill=None)
        if prefills and (decodes or first_token_ends):
            prefill = self.pick_prefill(prompt, prefills, namespace)
            self.affinity.record(prompt, prefill.address, namespace)
            if first_token_ends:
                return Route(decode=None, prefill=prefill)
            return Route(decode=self._pick_decode(prompt, decodes, namespace), prefill=prefill)
        colocated = usable(self.pool.colocated)
        if colocated:
            return Route(decode=self._pick_decode(prompt, colocated, namespace), prefill=None)
        return None

    def _pick_decode(
        self, prompt: Sequence[int], candidates: list[Node], namespace: Namespace
    ) -> Node:
        """The generating node for ``prompt`` among ``candidates``, recorded in
        ``decode_affinity``."""
        node = _pick_affine(
            prompt,
            candidates,
            namespace,
            self.decode_affinity,
            _decode_work,
            self.config.affinity_max_imbalance,
        )
        self.decode_affinity.record(prompt, node.address, namespace)
        return node

    def why_none(
        self, prompt: Sequence[int], lora_name: str | None = None, first_token_ends: bool = False
    ) -> str:
        """Why ``pick`` finds no route for ``prompt`` of adapter ``lora_name`` (ending at its
        first token or not) now, the nodes a request tried aside: what a client's 503 names
        first."""

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
            prefill_up, decode_up = any_healthy(self.pool.prefill), any_healthy(self.pool.decode)
            if first_token_ends:
                # A prefill node alone serves it; a decode node only a short prompt.
                if not prefill_up and (needs_prefill or not decode_up):
                    missing = ["prefill"] if needs_prefill else ["prefill", "decode"]
            else:
                if needs_prefill and not prefill_up:
                    missing.append("prefill")
                if not decode_up:
                    missing.append("decode")
            if missing:
                causes.append(f"no healthy {' or '.join(missing)} node")
            elif first_token_ends and prefill_up:
                tried = "prefill" if needs_prefill or not decode_up else "decode and prefill"
                causes.append(f"this request tried every healthy {tried} node")
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
        self.decode_affinity.forget(node.address)

    def pick_prefill(
        self, prompt: Sequence[int], candidates: list[Node], namespace: Namespace = BASE
    ) -> Node:
        return _pick_affine(
            prompt,
            candidates,
            namespace,
            self.affinity,
            _prefill_queue,
            self.config.affinity_max_imbalance,
        )


def _pick_affine(
    prompt: Sequence[int],
    candidates: list[Node],
    namespace: Namespace,
    index: PrefixAffinity,
    load: Callable[[Node], float],
    max_imbalance: float,
) -> Node:
    """The candidate ``index`` last gave the longest prefix of ``prompt``, while its ``load``
    is at most ``max_imbalance`` above the least; otherwise the least loaded."""
    least = min(load(n) for n in candidates)
    matches = index.matched_tokens(prompt, namespace)
    affine = [
        n for n in candidates if matches.get(n.address, 0) > 0 and load(n) <= least + max_imbalance
    ]
    if affine:
        return max(affine, key=lambda n: (matches[n.address], -load(n)))
    return min(candidates, key=load)

"""The router's choices from node health and load, and the prefix-affinity index behind them."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.config import RouterConfig
from gateway.routing.node import Node, NodeHealth, NodeLoad
from gateway.routing.node_census import RoleCensus
from gateway.routing.node_pool import NodePool
from gateway.routing.prefix_affinity import PrefixAffinity
from gateway.routing.router import Router
from services.types import Role

BLOCK = 4


def make_router(
    prefill: int = 2, decode: int = 2, colocated: int = 0, local_prefill_max_tokens: int = 0
) -> Router:
    pool = NodePool(
        tuple(f"127.0.0.1:{6100 + i}" for i in range(prefill)),
        tuple(f"127.0.0.1:{7100 + i}" for i in range(decode)),
        tuple(f"127.0.0.1:{8100 + i}" for i in range(colocated)),
    )
    for node in pool.nodes:
        node.health = NodeHealth.HEALTHY
    config = RouterConfig(
        prefill=tuple(n.address for n in pool.prefill),
        decode=tuple(n.address for n in pool.decode),
        colocated=tuple(n.address for n in pool.colocated),
        affinity_block_size=BLOCK,
        affinity_max_imbalance=2,
        local_prefill_max_tokens=local_prefill_max_tokens,
    )
    return Router(pool, config)


@pytest.fixture
def loop():
    # Node channels are grpc.aio objects: they want a loop to exist while they are created.
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    loop.close()


def test_affinity_matches_longest_shared_prefix() -> None:
    index = PrefixAffinity(block_size=BLOCK)
    index.record([1, 2, 3, 4, 5, 6, 7, 8], "a")
    index.record([1, 2, 3, 4, 9, 9, 9, 9], "b")
    assert index.matched_tokens([1, 2, 3, 4, 5, 6, 7, 8, 0]) == {"b": 4, "a": 8}
    assert index.matched_tokens([1, 2, 3, 4, 9, 9, 9, 9]) == {"b": 8}
    assert index.matched_tokens([2, 2, 3, 4]) == {}
    assert index.matched_tokens([1, 2, 3]) == {}  # no full block
    index.forget("b")
    assert index.matched_tokens([1, 2, 3, 4, 9, 9, 9, 9]) == {}


def test_affinity_keeps_salted_prompts_apart() -> None:
    index = PrefixAffinity(block_size=BLOCK)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    index.record(prompt, "a", ("tenant-1", None))
    index.record(prompt, "b")
    index.record(prompt, "c", (None, "sql-lora"))
    assert index.matched_tokens(prompt, ("tenant-1", None)) == {"a": 8}
    assert index.matched_tokens(prompt) == {"b": 8}
    assert index.matched_tokens(prompt, (None, "sql-lora")) == {"c": 8}
    assert index.matched_tokens(prompt, ("tenant-2", None)) == {}
    assert index.matched_tokens(prompt, ("tenant-1", "sql-lora")) == {}


def test_affinity_is_bounded() -> None:
    index = PrefixAffinity(block_size=1, max_entries=10)
    for i in range(100):
        index.record([1000 + i], "a")
    assert len(index) == 10
    assert index.matched_tokens([1099]) == {"a": 1}
    assert index.matched_tokens([1000]) == {}


def test_shared_prefix_goes_to_the_same_prefill(loop) -> None:
    router = make_router()
    system = list(range(100, 116))
    first = router.pick([*system, 1, 2, 3, 4])
    # The first request's node gets busier, but within the allowed imbalance.
    first.prefill.num_in_flight = 2
    again = router.pick([*system, 9, 9, 9, 9])
    assert again.prefill is first.prefill
    # Past the imbalance bound the shortest queue wins over affinity.
    first.prefill.num_in_flight = 3
    assert router.pick([*system, 7, 7, 7, 7]).prefill is not first.prefill


def test_a_shared_prefix_goes_to_the_same_decode_node(loop) -> None:
    """A decode node reuses a prefix its cache holds (it is not pushed again): a conversation's
    next turn stays on its decode node while that node is not too much busier."""
    router = make_router()
    chat = list(range(200, 216))
    first = router.pick([*chat, 1, 2, 3, 4]).decode
    other = next(n for n in router.pool.decode if n is not first)
    first.num_in_flight = 2  # within the imbalance bound (2 in make_router)
    assert router.pick([*chat, 1, 2, 3, 4, 5, 6, 7, 8]).decode is first
    first.num_in_flight = 3  # past it: the least work wins over affinity
    assert router.pick([*chat, 7, 7, 7, 7]).decode is other
    # That turn was recorded for the other node: its longer prefix now points there.
    first.num_in_flight = 0
    assert router.pick([*chat, 7, 7, 7, 7, 5, 5, 5, 5]).decode is other
    assert router.decode_affinity.matched_tokens([*chat, 1, 2, 3, 4]) == {
        other.address: 16,
        first.address: 20,
    }
    router.forget(first)
    assert router.decode_affinity.matched_tokens([*chat, 1, 2, 3, 4]) == {other.address: 16}


def test_colocated_nodes_keep_a_conversation_too(loop) -> None:
    router = make_router(prefill=0, decode=0, colocated=2)
    chat = list(range(300, 316))
    first = router.pick([*chat, 1]).decode
    first.num_in_flight = 1
    assert router.pick([*chat, 2]).decode is first
    assert router.pick([5] * 16).decode is not first  # unrelated: the least loaded


def test_unrelated_prompts_spread_by_queue_depth(loop) -> None:
    router = make_router()
    a = router.pick([1] * 8).prefill
    a.num_in_flight = 1
    assert router.pick([2] * 8).prefill is not a


def test_decode_by_load_and_kv_usage(loop) -> None:
    router = make_router(decode=3)
    d0, d1, d2 = router.pool.decode
    d0.load = NodeLoad(num_running=5, kv_blocks_used=10, kv_blocks_total=100)
    d1.load = NodeLoad(num_running=1, kv_blocks_used=95, kv_blocks_total=100)  # nearly full
    d2.load = NodeLoad(num_running=3, kv_blocks_used=10, kv_blocks_total=100)
    assert router.pick([1] * 8).decode is d2
    d2.num_in_flight = 9  # the gateway's own count is fresher than the last poll
    assert router.pick([1] * 8).decode is d0


def test_a_lora_request_goes_only_to_nodes_that_loaded_its_adapter(loop) -> None:
    router = make_router(colocated=1)
    (p0, p1), (d0, d1), (c0,) = router.pool.prefill, router.pool.decode, router.pool.colocated
    # Before their first report nodes may have any adapter: routed as the base model.
    assert router.pick([1] * 8, namespace=(None, "sql")) is not None
    for node in (p0, d0, c0):
        node.load = NodeLoad(lora_names=frozenset())
    for node in (p1, d1):
        node.load = NodeLoad(num_running=9, lora_names=frozenset({"sql"}))
    route = router.pick([1] * 8, namespace=(None, "sql"))
    assert route is not None and (route.prefill, route.decode) == (p1, d1)
    assert router.pick([1] * 8).decode is d0  # the base model: by load, as ever
    assert router.pick([1] * 8, exclude={"127.0.0.1:7101"}, namespace=(None, "sql")) is None
    assert router.why_none([1] * 8, "sql") == (
        "no healthy colocated node has loaded LoRA adapter 'sql' "
        "(their --lora-modules, or a run-time load)"
    )
    d1.load = NodeLoad(lora_names=frozenset())
    assert router.pick([1] * 8, namespace=(None, "sql")) is None
    assert "no healthy decode or colocated node has loaded LoRA adapter 'sql'" in (
        router.why_none([1] * 8, "sql")
    )


def test_embeddings_go_to_nodes_that_compute_prompts(loop) -> None:
    router = make_router(prefill=2, decode=2, colocated=1)
    p0, p1 = router.pool.prefill
    (c0,) = router.pool.colocated
    p0.load = NodeLoad(num_running=3)
    c0.load = NodeLoad(num_running=1)
    assert router.pick_embedder([1] * 8) is p1  # the shortest queue of prefill and colocated
    assert router.pick_embedder([1] * 8, exclude={p1.address}) is c0
    c0.load = NodeLoad(lora_names=frozenset({"sql"}))
    for node in (p0, p1):  # reported: no adapter (a node yet to report may have any)
        node.load = NodeLoad(lora_names=frozenset())
    assert router.pick_embedder([1] * 8, lora_name="sql") is c0  # the only one with it
    for node in (p0, p1, c0):
        node.health = NodeHealth.UNHEALTHY
    d0, d1 = router.pool.decode
    d0.load = NodeLoad(num_running=5)
    assert router.pick_embedder([1] * 8) is d1  # none computes prompts: a decode node does
    for node in (d0, d1):
        node.health = NodeHealth.UNHEALTHY
    assert router.pick_embedder([1] * 8) is None


def test_unhealthy_draining_and_excluded_nodes_are_skipped(loop) -> None:
    router = make_router(colocated=1)
    p0, p1 = router.pool.prefill
    d0, d1 = router.pool.decode
    p0.mark_failed("UNAVAILABLE")
    d1.load = NodeLoad(draining=True)
    route = router.pick([1] * 8)
    assert (route.prefill, route.decode) == (p1, d0)
    # Every pair tried: the colocated node is the fallback.
    route = router.pick([1] * 8, exclude={d0.address})
    assert route.kind == "colocated" and route.decode is router.pool.colocated[0]
    router.pool.colocated[0].health = NodeHealth.UNHEALTHY
    assert router.pick([1] * 8, exclude={d0.address}) is None


def test_readiness_needs_a_pair_or_a_colocated_node(loop) -> None:
    router = make_router(prefill=1, decode=1, colocated=1)
    pool = router.pool
    assert pool.is_ready()
    pool.colocated[0].health = NodeHealth.UNHEALTHY
    assert pool.is_ready()
    pool.prefill[0].health = NodeHealth.UNHEALTHY
    assert not pool.is_ready()
    pool.colocated[0].health = NodeHealth.HEALTHY
    assert pool.is_ready()


def test_the_census_counts_routable_nodes_of_each_role(loop) -> None:
    pool = make_router(prefill=2, decode=2).pool
    pool.prefill[1].health = NodeHealth.UNKNOWN  # not polled yet
    pool.decode[0].load = NodeLoad(draining=True)  # healthy, but no new requests
    census = pool.census()
    assert census.prefill == RoleCensus(num_healthy=1, num_total=2)
    assert census.decode == RoleCensus(num_healthy=1, num_total=2)
    assert census.colocated == RoleCensus(num_healthy=0, num_total=0)
    assert census.is_ready  # one pair serves while the others come up
    assert census.as_json()["prefill"] == {"healthy": 1, "total": 2}


def test_a_node_that_comes_back_loses_its_prefix_affinity(loop) -> None:
    router = make_router()
    prompt = list(range(100, 116))
    first = router.pick(prompt).prefill
    assert router.affinity.matched_tokens(prompt) == {first.address: 16}
    router.forget(first)  # what the gateway does when a poll finds it back from UNHEALTHY
    assert router.affinity.matched_tokens(prompt) == {}


def test_short_prompts_are_prefilled_on_the_least_loaded_decode_node(loop) -> None:
    router = make_router(local_prefill_max_tokens=16)
    d0, d1 = router.pool.decode
    d0.load = NodeLoad(num_running=3)
    route = router.pick([1] * 16)
    assert (route.prefill, route.decode, route.kind) == (None, d1, "local_prefill")
    assert router.affinity.matched_tokens([1] * 16) == {}  # no prefill node saw it
    route = router.pick([1] * 17)
    assert route.kind == "disaggregated" and route.decode is d1
    # A refusal by the only other decode node: the short prompt goes to the loaded one.
    route = router.pick([1] * 4, exclude={d1.address})
    assert (route.prefill, route.decode) == (None, d0)
    # No prefill node is needed for it: short prompts are served while none is healthy.
    for node in router.pool.prefill:
        node.mark_failed("UNAVAILABLE")
    assert router.pick([1] * 16).kind == "local_prefill"
    assert router.pick([1] * 17) is None


def test_a_request_ending_at_its_first_token_goes_to_a_prefill_node_alone(loop) -> None:
    router = make_router(local_prefill_max_tokens=4)
    p0, p1 = router.pool.prefill
    p0.load = NodeLoad(num_waiting=5)
    route = router.pick([1] * 8, first_token_ends=True)
    assert (route.prefill, route.decode, route.kind) == (p1, None, "prefill_only")
    # Chosen as a pair's prefill node is: by prefix affinity too.
    assert router.affinity.matched_tokens([1] * 8) == {p1.address: 8}
    # A short prompt is still its decode node's to prefill.
    assert router.pick([1] * 4, first_token_ends=True).kind == "local_prefill"
    # Served while no decode node is healthy, a short prompt included.
    for node in router.pool.decode:
        node.mark_failed("UNAVAILABLE")
    assert router.pick([1] * 4, first_token_ends=True).kind == "prefill_only"
    assert router.pick([1] * 8) is None  # one that goes on needs a decode node
    assert router.why_none([1] * 8) == "no healthy decode node"
    route = router.pick([1] * 8, exclude={p1.address}, first_token_ends=True)
    assert route.prefill is p0
    assert router.pick([1] * 8, exclude={p0.address, p1.address}, first_token_ends=True) is None
    assert router.why_none([1] * 8, first_token_ends=True) == (
        "this request tried every healthy prefill node"
    )
    for node in router.pool.prefill:
        node.mark_failed("UNAVAILABLE")
    assert router.why_none([1] * 8, first_token_ends=True) == "no healthy prefill node"
    assert router.why_none([1] * 4, first_token_ends=True) == "no healthy prefill or decode node"


def test_without_a_threshold_every_prompt_goes_to_a_prefill_node(loop) -> None:
    router = make_router()
    assert router.pick([7]).kind == "disaggregated"


def test_a_node_not_serving_yet_is_waited_for_and_a_lost_one_is_a_warning(caplog) -> None:
    """Nodes start beside the gateway: refused polls before the first answer are the normal
    start (INFO); a node that served and stops answering is a fault (WARNING)."""
    node = Node("127.0.0.1:1", Role.DECODE)
    refused = "UNAVAILABLE: connection refused"
    with caplog.at_level(logging.INFO, logger="gateway.routing.node"):
        assert not node.observe_poll(None, refused)
        assert node.health is NodeHealth.UNHEALTHY and not node.is_healthy
        assert not node.observe_poll(None, refused)  # logged once, not at every poll
        node.observe_poll(NodeLoad(), None)
        assert node.is_healthy
        assert not node.observe_poll(None, refused)
        assert node.observe_poll(NodeLoad(), None)  # back: it may have restarted empty
    levels = [(record.levelno, record.getMessage().split(": ", 1)[1]) for record in caplog.records]
    assert levels == [
        (logging.INFO, f"waiting for it to serve ({refused})"),
        (logging.INFO, "healthy"),
        (logging.WARNING, f"unhealthy ({refused})"),
        (logging.INFO, "healthy"),
    ]

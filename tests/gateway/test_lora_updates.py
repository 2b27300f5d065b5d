"""Run-time LoRA updates fanned out to the nodes (``gateway/routing/lora_updates.py``), over
scripted node clients: all or nothing for a load (a refusal rolls back the nodes that loaded
it), unhealthy nodes skipped and named, the routing state updated before the answer and kept
from polls sent before it. The real nodes' side: ``tests/integration/test_lora_serving.py``."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from gateway.errors import ErrorKind, GatewayError
from gateway.frontend import Frontend
from gateway.routing.lora_updates import LoraUpdates
from gateway.routing.node import Node, NodeHealth, NodeLoad
from gateway.routing.node_pool import NodePool
from services.types import Role


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class ScriptedClient:
    """A node's LoRA calls: each answers from its script (a value, or an exception to raise)."""

    def __init__(self, load: bool | Exception = True, unload: int | Exception = 0) -> None:
        self.load = load
        self.unload = unload
        self.calls: list[tuple[str, str]] = []

    async def load_lora_adapter(self, name: str, path: str, timeout_s: float) -> bool:
        self.calls.append(("load", name))
        if isinstance(self.load, Exception):
            raise self.load
        return self.load

    async def unload_lora_adapter(self, name: str, timeout_s: float, grace_ms: int = 0) -> int:
        self.calls.append(("unload", name))
        self.grace_ms = grace_ms
        if isinstance(self.unload, Exception):
            raise self.unload
        return self.unload


@pytest.fixture
def pool():
    # Node channels are grpc.aio objects: they want a loop to exist while they are created.
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    pool = NodePool(("127.0.0.1:6100",), ("127.0.0.1:7100", "127.0.0.1:7101"), ())
    for node in pool.nodes:
        node.health = NodeHealth.HEALTHY
        node.load = NodeLoad(lora_names=frozenset({"old"}))
    yield pool
    loop.run_until_complete(pool.close())
    loop.close()


def script(pool: NodePool, monkeypatch: pytest.MonkeyPatch, **clients: ScriptedClient):
    """Scripted clients by node (p0, d0, d1); the others answer as a healthy node would."""
    by_address = {}
    for node in pool.nodes:
        key = f"{node.role.value[0]}{node.address[-1]}"
        by_address[node.address] = clients.get(key, ScriptedClient())
    monkeypatch.setattr(pool, "client", lambda node: by_address[node.address])
    return by_address


def names(node: Node) -> frozenset[str] | None:
    return node.load.lora_names


def run(coro):
    return asyncio.get_event_loop().run_until_complete(coro)


def test_a_load_reaches_every_healthy_node_and_routes_at_once(pool, monkeypatch) -> None:
    clients = script(pool, monkeypatch)
    skipped = pool.decode[1]
    skipped.health = NodeHealth.UNHEALTHY
    message = run(LoraUpdates(pool).load("sql", "/adapters/sql"))
    assert message.startswith("Success: LoRA adapter 'sql' added successfully.")
    assert skipped.address in message  # named: it will lack the adapter
    assert clients[skipped.address].calls == []
    for node in (pool.prefill[0], pool.decode[0]):
        assert names(node) == {"old", "sql"}
    assert names(skipped) == {"old"}
    assert pool.lora_names() == {"old", "sql"}


def test_a_refusal_rolls_back_the_nodes_that_loaded_it(pool, monkeypatch) -> None:
    full = rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "max_loras: max_loras 1 adapters ...")
    clients = script(pool, monkeypatch, d1=ScriptedClient(load=full))
    with pytest.raises(GatewayError) as error:
        run(LoraUpdates(pool).load("sql", "/adapters/sql"))
    assert error.value.kind is ErrorKind.INVALID_ARGUMENT
    assert "node 127.0.0.1:7101 (decode): max_loras" in error.value.message
    for node in pool.nodes:
        assert names(node) == {"old"}  # as before the call
    for address in ("127.0.0.1:6100", "127.0.0.1:7100"):
        assert clients[address].calls == [("load", "sql"), ("unload", "sql")]
    assert clients["127.0.0.1:7101"].calls == [("load", "sql")]


def test_node_refusals_name_the_field(pool, monkeypatch) -> None:
    bad = rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "lora_path: /x: no adapter_config.json")
    script(pool, monkeypatch, p0=ScriptedClient(load=bad), d0=ScriptedClient(load=bad),
           d1=ScriptedClient(load=bad))  # fmt: skip
    with pytest.raises(GatewayError) as error:
        run(LoraUpdates(pool).load("sql", "/x"))
    assert (error.value.kind, error.value.param) == (ErrorKind.INVALID_ARGUMENT, "lora_path")
    down = rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")
    script(pool, monkeypatch, d0=ScriptedClient(load=down))
    with pytest.raises(GatewayError) as error:
        run(LoraUpdates(pool).load("sql", "/adapters/sql"))
    assert error.value.kind is ErrorKind.UNAVAILABLE
    assert "127.0.0.1:7100" in error.value.message


def test_loading_what_every_node_has_is_vllms_400(pool, monkeypatch) -> None:
    script(pool, monkeypatch, p0=ScriptedClient(load=False), d0=ScriptedClient(load=False),
           d1=ScriptedClient(load=False))  # fmt: skip
    with pytest.raises(GatewayError, match="has already been loaded") as error:
        run(LoraUpdates(pool).load("old", "/adapters/old"))
    assert error.value.param == "lora_name"
    # A node that lacks it (restarted) makes the same call a load.
    script(pool, monkeypatch, p0=ScriptedClient(load=False), d0=ScriptedClient(load=False))
    assert run(LoraUpdates(pool).load("old", "/adapters/old")).startswith("Success")


def test_an_unload_reaches_every_node_and_404s_where_none_has_it(pool, monkeypatch) -> None:
    missing = rpc_error(grpc.StatusCode.NOT_FOUND, "lora_name: no LoRA adapter 'old' is loaded")
    clients = script(
        pool, monkeypatch, d0=ScriptedClient(unload=missing), d1=ScriptedClient(unload=3)
    )
    message = run(LoraUpdates(pool, prefill_grace_ms=30_000).unload("old"))
    assert message == "Success: LoRA adapter 'old' removed successfully."
    # Prefill nodes keep it for the requests already reserved on a decode node.
    assert [clients[n.address].grace_ms for n in pool.nodes] == [30_000, 0, 0]
    assert all(names(node) == frozenset() for node in pool.nodes)
    script(pool, monkeypatch, p0=ScriptedClient(unload=missing), d0=ScriptedClient(unload=missing),
           d1=ScriptedClient(unload=missing))  # fmt: skip
    with pytest.raises(GatewayError, match="cannot be found") as error:
        run(LoraUpdates(pool).unload("old"))
    assert (error.value.kind, error.value.param) == (ErrorKind.NOT_FOUND, "lora_name")


def test_an_unload_a_node_fails_names_it_and_what_was_unloaded(pool, monkeypatch) -> None:
    down = rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline")
    script(pool, monkeypatch, d1=ScriptedClient(unload=down))
    with pytest.raises(GatewayError) as error:
        run(LoraUpdates(pool).unload("old"))
    assert error.value.kind is ErrorKind.UNAVAILABLE
    assert "127.0.0.1:7101" in error.value.message
    assert "unloaded on: 127.0.0.1:6100, 127.0.0.1:7100" in error.value.message
    assert names(pool.decode[1]) == {"old"}


def test_a_node_back_or_new_gets_the_adapters_loaded_through_the_gateway(
    pool, monkeypatch, caplog
) -> None:
    clients = script(pool, monkeypatch)
    updates = LoraUpdates(pool)
    skipped = pool.decode[1]
    skipped.health = NodeHealth.UNHEALTHY
    run(updates.load("sql", "/adapters/sql"))
    run(updates.load("chat", "/adapters/chat"))
    assert run(updates.restore(skipped)) == []  # not healthy: nothing sent yet
    # Back (restarted: only its --lora-modules), it reports "old": it gets sql and chat.
    assert skipped.observe_poll(NodeLoad(lora_names=frozenset({"old"})), None)
    assert run(updates.restore(skipped)) == ["chat", "sql"]
    assert clients[skipped.address].calls == [("load", "chat"), ("load", "sql")]
    assert names(skipped) == {"old", "sql", "chat"}
    # Nothing to do for a node that has them all.
    assert run(updates.restore(pool.decode[0])) == []
    # An adapter unloaded since, or that no other healthy node has any more, is not brought
    # back; a node's refusal is logged and leaves it without the adapter.
    run(updates.unload("chat"))
    for node in (pool.prefill[0], pool.decode[0]):
        node.set_lora_names(names(node) - {"sql"})  # as if unloaded through another gateway
    full = rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "max_loras: 1 loaded")
    clients[skipped.address].load = full
    skipped.set_lora_names(frozenset())
    assert run(updates.restore(skipped)) == []
    assert clients[skipped.address].calls[-1] == ("unload", "chat")  # nothing sent since
    pool.decode[0].set_lora_names(frozenset({"sql"}))
    with caplog.at_level(logging.WARNING, logger="gateway.routing.lora_updates"):
        assert run(updates.restore(skipped)) == []
    assert clients[skipped.address].calls[-1] == ("load", "sql")
    assert "did not take LoRA adapter 'sql' back" in caplog.text
    assert names(skipped) == frozenset()


def test_a_new_node_counts_as_turned_healthy() -> None:
    # A replica that joins (DNS) answers SERVING at its first poll: restore must see it too.
    node = Node("127.0.0.1:7102", Role.DECODE)
    assert node.observe_poll(NodeLoad(), None)
    assert not node.observe_poll(NodeLoad(), None)


def test_no_healthy_node_is_503(pool, monkeypatch) -> None:
    script(pool, monkeypatch)
    for node in pool.nodes:
        node.health = NodeHealth.UNHEALTHY
    with pytest.raises(GatewayError) as error:
        run(LoraUpdates(pool).load("sql", "/adapters/sql"))
    assert error.value.kind is ErrorKind.UNAVAILABLE


def test_a_poll_sent_before_an_update_does_not_undo_it() -> None:
    node = Node("127.0.0.1:7100", Role.DECODE)
    version = node.lora_version
    node.set_lora_names(frozenset({"sql"}))
    node.observe_poll(NodeLoad(num_running=3, lora_names=frozenset()), None, lora_version=version)
    assert node.load.num_running == 3 and names(node) == {"sql"}
    node.observe_poll(NodeLoad(lora_names=frozenset()), None, lora_version=node.lora_version)
    assert names(node) == frozenset()  # a poll sent after it is the node's word


def test_the_gateway_serves_the_adapters_the_nodes_report() -> None:
    reported: list[frozenset[str] | None] = [None]
    frontend = Frontend(
        served_model_name="base",
        served_model_aliases=("alias",),
        tokenizer=None,
        generator=None,
        admission=None,
        api_keys=None,
        limits=None,
        metrics=None,
        node_census=lambda: None,
        lora_modules=("sql",),
        node_lora_names=lambda: reported[0],
    )
    assert frontend.model_names == ("base", "alias", "sql")  # before any report: the flag's
    reported[0] = frozenset({"chat", "sql", "base"})
    assert frontend.lora_names == ("chat", "sql")  # a base model's name means the base model
    assert frontend.lora_name("chat") == "chat" and frontend.lora_name("base") is None
    reported[0] = frozenset()
    assert frontend.model_names == ("base", "alias") and frontend.lora_name("sql") is None

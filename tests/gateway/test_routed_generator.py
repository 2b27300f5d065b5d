"""The routed generator's retries, recompute and event order, driven with fake legs: no node
processes, no gRPC. Each fake leg records what the generator asked of it; every test also
checks that each leg counted itself in flight while open and that no count is left behind."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field, replace
from types import TracebackType

import pytest

from gateway.config import RouterConfig
from gateway.errors import ErrorKind, GatewayError
from gateway.generation import (
    Finished,
    GenerationEvent,
    GenerationRequest,
    TokenChunk,
    stop_early,
)
from gateway.key_limiter import KeyMeteredGenerator
from gateway.metrics import GatewayMetrics
from gateway.routing.legs import (
    DecodeEvent,
    DecodeLeg,
    PrefillLeg,
    PrefillReply,
    Recomputing,
    RetryableFailure,
    StreamEnded,
)
from gateway.routing.node import Node, NodeHealth
from gateway.routing.routed_generator import RoutedGenerator
from gateway.routing.router import Route
from services.types import FinishReason, Role, SamplingParams, StageTimings, Usage

PROMPT = (1, 2, 3)
DECODE_TIMINGS = StageTimings(decode_queue_s=0.5, decode_s=2.0)
PREFILL_TIMINGS = StageTimings(prefill_queue_s=0.25, prefill_compute_s=1.0, kv_transfer_s=0.125)

# A decode script: what ``reservation()`` does (None: answers), then the events ``next()``
# returns in order (an exception instance is raised instead).
DecodeScript = tuple[Exception | None, list[DecodeEvent | Exception]]


def finished(completion_tokens: int) -> Finished:
    return Finished(FinishReason.LENGTH, Usage(len(PROMPT), completion_tokens), DECODE_TIMINGS)


def served(*token_ids: int) -> DecodeScript:
    return None, [*(TokenChunk((t,)) for t in token_ids), finished(len(token_ids) + 1)]


@dataclass
class FakeDecodeLeg(DecodeLeg):
    node: Node
    script: DecodeScript
    legs: FakeLegs
    wait_for_room: bool
    streamed: bool = False
    closed: bool = False
    events: list[DecodeEvent | Exception] = field(init=False)

    async def __aenter__(self) -> FakeDecodeLeg:
        self.events = list(self.script[1])
        self.node.num_in_flight += 1
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.closed = True
        self.node.num_in_flight -= 1

    async def reservation(self) -> object:
        if self.script[0] is not None:
            raise self.script[0]
        return f"reservation on {self.node.address}"

    async def next(self) -> DecodeEvent:
        await self.legs.decode_gate.wait()
        event = self.events.pop(0)
        if isinstance(event, Exception):
            raise event
        return event


@dataclass
class FakePrefillLeg(PrefillLeg):
    node: Node
    outcome: PrefillReply | Exception
    legs: FakeLegs
    reservation: object = None
    cancelled: bool = False
    counted: bool = False

    async def __aenter__(self) -> FakePrefillLeg:
        self.node.num_in_flight += 1
        self.counted = True
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.counted:
            self.node.num_in_flight -= 1

    async def reply(self, reservation: object) -> PrefillReply:
        self.reservation = reservation
        try:
            await self.legs.prefill_gate.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        if isinstance(self.outcome, Exception):
            raise self.outcome
        self.node.num_in_flight -= 1
        self.counted = False
        return self.outcome


@dataclass
class FakeLegs:
    decode_scripts: dict[str, DecodeScript]
    prefill_outcomes: dict[str, PrefillReply | Exception] = field(default_factory=dict)
    opened: list[FakeDecodeLeg | FakePrefillLeg] = field(default_factory=list)
    leg_ids: list[str] = field(default_factory=list)
    decode_gate: asyncio.Event = field(default_factory=asyncio.Event)
    prefill_gate: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.decode_gate.set()
        self.prefill_gate.set()

    def decode(
        self,
        node: Node,
        leg_id: str,
        request: GenerationRequest,
        prefill: Node | None,
        timeout: float | None,
        wait_for_room: bool,
    ) -> FakeDecodeLeg:
        self.leg_ids.append(leg_id)
        leg = FakeDecodeLeg(node, self.decode_scripts[node.address], self, wait_for_room)
        self.opened.append(leg)
        return leg

    def prefill(
        self,
        node: Node,
        leg_id: str,
        request: GenerationRequest,
        decode: Node,
        timeout: float | None,
    ) -> FakePrefillLeg:
        leg = FakePrefillLeg(node, self.prefill_outcomes[node.address], self)
        self.opened.append(leg)
        return leg


class PairRouter:
    """Picks the first pair (or colocated node) not excluded, as the real router's retry does."""

    def __init__(self, routes: list[Route]) -> None:
        self.routes = routes
        self.first_token_ends: list[bool] = []
        """What each pick was told of the request."""

    def pick(
        self,
        prompt: object,
        exclude: set[str] | frozenset[str] = frozenset(),
        namespace: object = None,
        first_token_ends: bool = False,
    ) -> Route | None:
        self.first_token_ends.append(first_token_ends)
        for route in self.routes:
            nodes = [node for node in (route.decode, route.prefill) if node is not None]
            if not any(node.address in exclude for node in nodes):
                return route
        return None

    def why_none(
        self, prompt: object, lora_name: str | None = None, first_token_ends: bool = False
    ) -> str:
        return "every pair was tried"


def healthy(address: str, role: Role) -> Node:
    node = Node(address, role)
    node.health = NodeHealth.HEALTHY
    return node


def pairs(count: int) -> list[Route]:
    return [
        Route(decode=healthy(f"d{i}", Role.DECODE), prefill=healthy(f"p{i}", Role.PREFILL))
        for i in range(count)
    ]


def reply(token_id: int) -> PrefillReply:
    return PrefillReply(TokenChunk((token_id,)), cached_prompt_tokens=2, timings=PREFILL_TIMINGS)


def make_generator(routes: list[Route], legs: FakeLegs) -> RoutedGenerator:
    config = RouterConfig(prefill=("127.0.0.1:1",), decode=("127.0.0.1:2",), colocated=())
    return RoutedGenerator(PairRouter(routes), config, GatewayMetrics(), legs)  # type: ignore[arg-type]


def request() -> GenerationRequest:
    return GenerationRequest("req", PROMPT, SamplingParams(max_tokens=8))


async def collect(generator: RoutedGenerator) -> list[GenerationEvent]:
    return await collect_request(generator, request())


async def collect_request(
    generator: RoutedGenerator, sent: GenerationRequest
) -> list[GenerationEvent]:
    return [event async for event in generator.generate(sent)]


def token_ids(events: list[GenerationEvent]) -> list[int]:
    return [t for e in events if isinstance(e, TokenChunk) for t in e.token_ids]


def assert_no_work_left(routes: list[Route], legs: FakeLegs) -> None:
    for route in routes:
        assert route.decode is None or route.decode.num_in_flight == 0
        assert route.prefill is None or route.prefill.num_in_flight == 0
    assert all(leg.closed for leg in legs.opened if isinstance(leg, FakeDecodeLeg))


def test_a_full_decode_node_is_retried_on_the_next_pair_under_a_fresh_leg_id() -> None:
    routes = pairs(2)
    full = RetryableFailure("decode_full", routes[0].decode, "no room")
    legs = FakeLegs({"d0": (full, []), "d1": served(11, 12)}, {"p0": reply(10), "p1": reply(10)})
    events = asyncio.run(collect(make_generator(routes, legs)))
    assert token_ids(events) == [10, 11, 12]
    final = events[-1]
    assert isinstance(final, Finished) and final.num_retries == 1
    first, retry = legs.leg_ids
    assert first.startswith("req.") and retry == f"{first}.r1"
    first_prefill = next(leg for leg in legs.opened if leg.node is routes[0].prefill)
    assert isinstance(first_prefill, FakePrefillLeg) and first_prefill.reservation is None
    assert_no_work_left(routes, legs)


def test_a_failed_prefill_ends_the_attempt_and_the_next_pair_serves() -> None:
    routes = pairs(2)
    down = RetryableFailure("prefill_unavailable", routes[0].prefill, "connection refused")
    legs = FakeLegs({"d0": served(11), "d1": served(21)}, {"p0": down, "p1": reply(20)})
    events = asyncio.run(collect(make_generator(routes, legs)))
    assert token_ids(events) == [20, 21]
    first_decode = legs.opened[0]
    assert isinstance(first_decode, FakeDecodeLeg) and first_decode.closed
    assert_no_work_left(routes, legs)


def test_every_decode_full_then_one_attempt_waits_for_room_and_a_full_queue_is_429() -> None:
    routes = pairs(2)
    legs = FakeLegs(
        {f"d{i}": (RetryableFailure("decode_full", r.decode, "no room"), []) for i, r in
         enumerate(routes)},
        {"p0": reply(10), "p1": reply(10)},
    )  # fmt: skip
    generator = make_generator(routes, legs)
    with pytest.raises(GatewayError) as raised:
        asyncio.run(collect(generator))
    assert raised.value.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert raised.value.reason == "no_capacity"
    assert errors_counted(generator) == {}, "the front end counts it, once"
    waits = [leg.wait_for_room for leg in legs.opened if isinstance(leg, FakeDecodeLeg)]
    assert waits == [False, False, True], "two refusals, then one attempt that queues"
    assert_no_work_left(routes, legs)


def test_recompute_cancels_the_prefill_and_takes_every_token_from_the_decode_stream() -> None:
    routes = pairs(1)
    legs = FakeLegs({"d0": (None, [Recomputing(), *served(5, 6, 7)[1]])}, {"p0": reply(99)})
    legs.prefill_gate.clear()  # the prefill never answers: the decode node takes over
    events = asyncio.run(collect(make_generator(routes, legs)))
    assert token_ids(events) == [5, 6, 7]
    prefill = next(leg for leg in legs.opened if isinstance(leg, FakePrefillLeg))
    assert prefill.cancelled
    final = events[-1]
    assert isinstance(final, Finished) and final.timings.prefill_compute_s == 0.0
    assert final.num_retries == 0
    assert_no_work_left(routes, legs)


def test_decode_tokens_that_overtake_the_prefill_reply_wait_behind_the_first_token() -> None:
    routes = pairs(1)
    legs = FakeLegs({"d0": served(11, 12)}, {"p0": reply(10)})
    legs.prefill_gate.clear()

    async def run() -> list[GenerationEvent]:
        generator = make_generator(routes, legs).generate(request())
        first = asyncio.ensure_future(anext(generator))
        # The decode stream is read (and held) while the prefill has not answered.
        for _ in range(20):
            await asyncio.sleep(0)
        assert not first.done()
        assert routes[0].prefill is not None and routes[0].prefill.num_in_flight == 1
        legs.prefill_gate.set()
        events = [await first]
        assert routes[0].prefill.num_in_flight == 0, "the prefill leg stops counting at its reply"
        assert routes[0].decode.num_in_flight == 1
        events += [event async for event in generator]
        return events

    events = asyncio.run(run())
    assert token_ids(events) == [10, 11, 12]
    final = events[-1]
    assert isinstance(final, Finished)
    assert final.usage.cached_prompt_tokens == 2, "the prefill's cache hits reach the usage"
    assert final.timings.prefill_compute_s == PREFILL_TIMINGS.prefill_compute_s
    assert final.timings.decode_s == DECODE_TIMINGS.decode_s
    assert_no_work_left(routes, legs)


def test_generations_with_one_client_id_reach_the_nodes_under_ids_of_their_own() -> None:
    """Clients reuse ids (X-Request-Id); the nodes refuse an id in use and key reservations and
    pushes by it, so each generation is sent under ``{request_id}.{12 hex}``."""
    routes = pairs(1)
    legs = FakeLegs({"d0": served(11, 12)}, {"p0": reply(10)})
    generator = make_generator(routes, legs)

    async def main() -> list[list[GenerationEvent]]:
        return await asyncio.gather(*(collect(generator) for _ in range(3)))

    assert [token_ids(events) for events in asyncio.run(main())] == [[10, 11, 12]] * 3
    assert len(set(legs.leg_ids)) == 3
    assert all(re.fullmatch(r"req\.[0-9a-f]{12}", leg_id) for leg_id in legs.leg_ids)
    assert_no_work_left(routes, legs)


def test_a_failure_after_a_token_is_a_finished_error_not_a_retry() -> None:
    routes = pairs(2)
    lost = StreamEnded(FinishReason.ERROR, "decode node lost")
    legs = FakeLegs({"d0": (None, [TokenChunk((11,)), lost]), "d1": served(21)},
                    {"p0": reply(10), "p1": reply(20)})  # fmt: skip
    events = asyncio.run(collect(make_generator(routes, legs)))
    assert token_ids(events) == [10, 11]
    final = events[-1]
    assert isinstance(final, Finished) and final.finish_reason is FinishReason.ERROR
    assert final.error == "decode node lost" and final.usage.completion_tokens == 2
    assert len(legs.leg_ids) == 1, "nothing is retried once a token reached the client"
    assert_no_work_left(routes, legs)


def test_closing_the_stream_early_cancels_both_legs() -> None:
    routes = pairs(1)
    legs = FakeLegs({"d0": served(11, 12, 13)}, {"p0": reply(10)})

    async def run() -> None:
        generator = make_generator(routes, legs).generate(request())
        assert isinstance(await anext(generator), TokenChunk)
        legs.decode_gate.clear()  # the next read blocks: the client leaves meanwhile
        await generator.aclose()

    asyncio.run(run())
    assert_no_work_left(routes, legs)


def test_a_colocated_node_serves_alone_and_skips_a_recomputing_notice() -> None:
    node = healthy("c0", Role.COLOCATED)
    routes = [Route(decode=node, prefill=None)]
    legs = FakeLegs({"c0": (None, [Recomputing(), *served(1, 2)[1]])})
    events = asyncio.run(collect(make_generator(routes, legs)))
    assert token_ids(events) == [1, 2]
    assert [type(leg) for leg in legs.opened] == [FakeDecodeLeg]
    assert_no_work_left(routes, legs)


def test_a_request_ending_at_its_first_token_is_the_prefill_nodes_alone() -> None:
    """``max_tokens=1``: one Prefill call without a reservation; its reply is the token and the
    request's end, with the prefill node's usage and stages. A failed call is retried on the
    next prefill node, and no decode leg is ever opened."""
    routes = [Route(decode=None, prefill=healthy(f"p{i}", Role.PREFILL)) for i in range(2)]
    ended = replace(reply(20), finish_reason=FinishReason.STOP)  # an EOS
    down = RetryableFailure("prefill_unavailable", routes[0].prefill, "connection refused")
    legs = FakeLegs({}, {"p0": down, "p1": ended})
    generator = make_generator(routes, legs)
    one = GenerationRequest("req", PROMPT, SamplingParams(max_tokens=1))
    events = asyncio.run(collect_request(generator, one))
    assert token_ids(events) == [20]
    final = events[-1]
    assert isinstance(final, Finished) and final.finish_reason is FinishReason.STOP
    assert final.usage == Usage(len(PROMPT), 1, cached_prompt_tokens=2)
    assert final.timings == replace(PREFILL_TIMINGS, gateway_queue_s=final.timings.gateway_queue_s)
    assert final.num_retries == 1 and final.error is None
    assert all(isinstance(leg, FakePrefillLeg) for leg in legs.opened)
    assert [leg.reservation for leg in legs.opened] == [None, None]
    assert generator.router.first_token_ends == [True, True]  # type: ignore[attr-defined]
    assert sample(generator, "request_attempts_total", route="prefill_only") == 2
    assert_no_work_left(routes, legs)
    # A request that goes on is routed as ever.
    on = make_generator(pairs(1), FakeLegs({"d0": served(11)}, {"p0": reply(10)}))
    assert token_ids(asyncio.run(collect(on))) == [10, 11]
    assert on.router.first_token_ends == [False]  # type: ignore[attr-defined]


def test_a_prefill_node_that_does_not_end_a_one_token_request_is_an_error_not_silence() -> None:
    routes = [Route(decode=None, prefill=healthy("p0", Role.PREFILL))]
    legs = FakeLegs({}, {"p0": reply(20)})  # no finish reason: a node's bug
    one = GenerationRequest("req", PROMPT, SamplingParams(max_tokens=1))
    events = asyncio.run(collect_request(make_generator(routes, legs), one))
    assert token_ids(events) == [20]
    final = events[-1]
    assert isinstance(final, Finished) and final.finish_reason is FinishReason.ERROR
    assert final.error == "prefill node p0 did not end a max_tokens=1 request"
    assert_no_work_left(routes, legs)


# --- metrics: finished requests here, failed ones by the front end -----------------------------


def sample(generator: RoutedGenerator, name: str, **labels: str) -> float:
    value = generator.metrics.registry.get_sample_value(f"pdserve:{name}", labels)
    return 0.0 if value is None else value


def errors_counted(generator: RoutedGenerator) -> dict[str, float]:
    return {
        s.labels["reason"]: s.value
        for metric in generator.metrics.request_errors.collect()
        for s in metric.samples
        if s.name.endswith("_total")
    }


@pytest.mark.parametrize("wrapped", [False, True], ids=["routed", "key_metered"])
def test_a_stop_string_ends_the_request_as_finished_with_the_stages_known(wrapped: bool) -> None:
    """The consumer stops the generation (a stop string) after two tokens: the legs are
    cancelled before the Finished goes out, and the request counts as finished with reason stop,
    with the prefill node's stages (its reply) and none of the decode node's (its Finished never
    comes). Counted the same through the key-metering wrapper the server puts around it."""
    routes = pairs(1)
    legs = FakeLegs({"d0": served(11, 12, 13)}, {"p0": reply(10)})
    generator = make_generator(routes, legs)

    async def run() -> Finished | None:
        outer = KeyMeteredGenerator(generator) if wrapped else generator
        queued = replace(request(), arrival=time.monotonic() - 0.5)  # waited for admission
        events = outer.generate(queued)
        assert token_ids([await anext(events), await anext(events)]) == [10, 11]
        final = await stop_early(events)
        assert routes[0].decode.num_in_flight == 0, "cancelled before the Finished went out"
        return final

    final = asyncio.run(run())
    assert final is not None and final.finish_reason is FinishReason.STOP
    assert final.usage == Usage(len(PROMPT), 2, cached_prompt_tokens=2)
    assert final.timings == replace(PREFILL_TIMINGS, gateway_queue_s=final.timings.gateway_queue_s)
    assert final.timings.gateway_queue_s >= 0.5
    assert_no_work_left(routes, legs)
    assert sample(generator, "request_success_total", finished_reason="stop") == 1
    assert sample(generator, "e2e_request_latency_seconds_count") == 1
    for stage in ("gateway_queue", "prefill_queue", "prefill_compute", "kv_transfer"):
        assert sample(generator, "request_stage_seconds_count", stage=stage) == 1, stage
    for stage in ("decode_queue", "first_decode_step", "decode"):
        assert sample(generator, "request_stage_seconds_count", stage=stage) == 0, stage


@pytest.mark.parametrize("wrapped", [False, True], ids=["routed", "key_metered"])
def test_stopped_at_its_finished_the_request_counts_as_a_stop(wrapped: bool) -> None:
    """The nodes ended the generation (length) and the consumer, flushing its held text, found
    a stop string there: stopped at the Finished, it gets that Finished as a stop, counted so
    (once: not as length too), with the decode node's stages it reported."""
    routes = pairs(1)
    legs = FakeLegs({"d0": served(11, 12)}, {"p0": reply(10)})
    generator = make_generator(routes, legs)

    async def run() -> Finished | None:
        outer = KeyMeteredGenerator(generator) if wrapped else generator
        events = outer.generate(request())
        seen = [await anext(events) for _ in range(4)]
        assert isinstance(seen[-1], Finished) and seen[-1].finish_reason is FinishReason.LENGTH
        return await stop_early(events)

    final = asyncio.run(run())
    assert final is not None and final.finish_reason is FinishReason.STOP
    assert final.usage == Usage(len(PROMPT), 3, cached_prompt_tokens=2)
    assert_no_work_left(routes, legs)
    counted = {
        s.labels["finished_reason"]: s.value
        for m in generator.metrics.requests_finished.collect()
        for s in m.samples
        if s.name.endswith("_total")
    }
    assert counted == {"stop": 1}
    assert sample(generator, "e2e_request_latency_seconds_count") == 1
    assert sample(generator, "request_stage_seconds_count", stage="decode") == 1


def test_a_request_closed_early_is_not_counted_finished() -> None:
    """A client gone closes the events (no StopGeneration): nothing says the request finished."""
    routes = pairs(1)
    legs = FakeLegs({"d0": served(11, 12, 13)}, {"p0": reply(10)})
    generator = make_generator(routes, legs)

    async def run() -> None:
        events = generator.generate(request())
        await anext(events)
        await events.aclose()

    asyncio.run(run())
    assert_no_work_left(routes, legs)
    assert sample(generator, "e2e_request_latency_seconds_count") == 0
    assert not [s for m in generator.metrics.requests_finished.collect() for s in m.samples]


def test_failures_are_named_for_the_front_end_not_counted_here() -> None:
    generator = make_generator([], FakeLegs({}))  # no pair to pick
    with pytest.raises(GatewayError) as raised:
        asyncio.run(collect(generator))
    assert raised.value.kind is ErrorKind.UNAVAILABLE and raised.value.reason == "no_node"

    lost = StreamEnded(FinishReason.ERROR, "decode node lost")
    legs = FakeLegs({"d0": (None, [TokenChunk((11,)), lost])}, {"p0": reply(10)})
    generator = make_generator(pairs(1), legs)
    events = asyncio.run(collect(generator))
    assert isinstance(events[-1], Finished) and events[-1].finish_reason is FinishReason.ERROR
    assert sample(generator, "request_success_total", finished_reason="error") == 1
    assert errors_counted(generator) == {}, "the front end counts it, once"

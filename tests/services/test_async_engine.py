"""AsyncEngine: the engine thread serving asyncio callers, with cancellation and shutdown."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from services.async_engine import AsyncEngine, EngineDeadError
from services.engine import LLM, EngineCore, FinishReason, SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def make_engine(model_dir: Path) -> EngineCore:
    return LLM(model_dir, dtype="float32", max_model_len=256, kv_cache_memory=2 << 20).engine


@pytest.fixture
def engine(tiny_llama_dir: Path) -> AsyncEngine:
    async_engine = AsyncEngine(make_engine(tiny_llama_dir))
    async_engine.start()
    yield async_engine
    async_engine.shutdown()


async def collect(engine: AsyncEngine, request_id: str, prompt: list[int], params) -> list[int]:
    tokens = []
    async for out in engine.generate(request_id, prompt, params):
        tokens.extend(out.new_token_ids)
    return tokens


async def wait_until(engine: AsyncEngine, predicate: Callable[[EngineCore], bool]) -> None:
    for _ in range(200):
        if await engine.call(predicate):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached within 2 s")


def test_concurrent_streams_share_one_batch_and_match_offline(
    engine: AsyncEngine, tiny_llama_dir: Path
) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 4096) for _ in range(n)] for n in (3, 20, 40, 7, 64, 33)]
    expected = [
        o.token_ids
        for o in LLM(tiny_llama_dir, dtype="float32", max_model_len=256).generate(prompts, GREEDY)
    ]
    batch_sizes: list[int] = []
    step = engine.engine.step

    def recording_step():
        batch_sizes.append(len(engine.engine.scheduler.running))
        return step()

    engine.engine.step = recording_step  # only the engine thread calls it

    async def main() -> list[list[int]]:
        return await asyncio.gather(
            *(collect(engine, f"r{i}", p, GREEDY) for i, p in enumerate(prompts))
        )

    assert asyncio.run(main()) == expected
    assert max(batch_sizes) > 1
    assert engine.engine.stats().num_blocks_used == 0


def test_a_consumer_that_stops_early_frees_the_request(engine: AsyncEngine) -> None:
    async def main() -> None:
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        stream = engine.generate("long", list(range(10, 50)), params)
        received = [await stream.__anext__(), await stream.__anext__()]
        assert all(not out.finished for out in received)
        await stream.aclose()  # what a closed gRPC stream does to its handler
        await wait_until(engine, lambda e: e.stats().num_blocks_used == 0)
        assert not await engine.call(lambda e: e.has_unfinished_requests)

    asyncio.run(main())


def test_a_cancelled_task_frees_the_request(engine: AsyncEngine) -> None:
    async def main() -> None:
        params = SamplingParams(max_tokens=500, ignore_eos=True)
        task = asyncio.create_task(collect(engine, "cancelled", list(range(10, 30)), params))
        await wait_until(engine, lambda e: e.stats().num_running == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(engine, lambda e: e.stats().num_blocks_used == 0)

    asyncio.run(main())


@pytest.mark.parametrize("hold_kv", [False, True], ids=["plain", "hold_kv"])
def test_a_caller_cancelled_before_its_add_ran_leaves_nothing(engine, hold_kv) -> None:
    """The add is queued behind a long command (a busy engine's step) when the caller goes
    away: it still runs on the engine thread, and must be taken out again — a prefill node's
    hold_kv request would otherwise keep its blocks for good."""

    async def main() -> None:
        busy = asyncio.ensure_future(engine.call(lambda e: time.sleep(0.3)))
        # hold_kv: a prefill node's first token; plain: a long generation nobody would read.
        params = SamplingParams(max_tokens=1 if hold_kv else 500, ignore_eos=True)

        async def first() -> None:
            async for _ in engine.generate("gone", list(range(10, 60)), params, hold_kv=hold_kv):
                pass

        task = asyncio.ensure_future(first())
        await asyncio.sleep(0.05)  # its add waits behind the busy command
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await busy
        await asyncio.sleep(0.2)  # a step or two, if anything was left running
        stats = await engine.call(lambda e: e.stats())
        assert stats.num_blocks_used == 0 and stats.num_held == 0, stats
        assert not await engine.call(lambda e: e.has_unfinished_requests)

    asyncio.run(main())


def test_a_caller_cancelled_before_its_reservation_ran_leaves_nothing(engine) -> None:
    """A decode node's reservation queued behind a long command when its Generate stream goes
    away: it still runs, and is taken back — no transfer was recorded to free it later."""
    gate = threading.Event()

    async def main() -> None:
        busy = asyncio.ensure_future(engine.call(lambda e: gate.wait(5)))
        task = asyncio.ensure_future(engine.reserve("gone", list(range(10, 60)), GREEDY))
        await asyncio.sleep(0)  # the reservation is queued behind the busy command
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        await busy
        assert await engine.call(lambda e: e.stats().num_blocks_used) == 0
        assert await engine.reserve("kept", list(range(10, 60)), GREEDY)
        assert await engine.call(lambda e: e.stats().num_blocks_used) > 0

    asyncio.run(main())


def test_bad_input_raises_value_error_and_leaks_nothing(engine: AsyncEngine) -> None:
    async def main() -> None:
        with pytest.raises(ValueError, match="prompt_token_ids is empty"):
            await collect(engine, "bad", [], GREEDY)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await collect(engine, "bad2", [1, 10**6], GREEDY)
        assert await engine.call(lambda e: e.stats().num_blocks_used) == 0
        assert await collect(engine, "good", [1, 2, 3], GREEDY) != []

    asyncio.run(main())


def test_call_runs_on_the_engine_thread(engine: AsyncEngine) -> None:
    name = asyncio.run(engine.call(lambda e: threading.current_thread().name))
    assert name == "engine" != threading.current_thread().name


def test_shutdown_ends_open_streams_with_abort(engine: AsyncEngine) -> None:
    async def main() -> None:
        params = SamplingParams(max_tokens=500, ignore_eos=True)
        stream = engine.generate("open", list(range(10, 30)), params)
        await stream.__anext__()
        engine.shutdown()
        outputs = [out async for out in stream]
        assert outputs[-1].finish_reason is FinishReason.ABORT
        with pytest.raises(EngineDeadError):
            await engine.call(lambda e: None)

    asyncio.run(main())
    assert engine.engine.stats().num_blocks_used == 0


def test_a_crashed_step_fails_every_stream(engine: AsyncEngine) -> None:
    def broken_step():
        raise RuntimeError("kernel exploded")

    async def main() -> None:
        engine.engine.step = broken_step
        with pytest.raises(EngineDeadError, match="kernel exploded"):
            await collect(engine, "doomed", [1, 2, 3], GREEDY)
        with pytest.raises(EngineDeadError):
            await engine.call(lambda e: None)

    asyncio.run(main())


def test_attach_streams_a_committed_reservation(engine: AsyncEngine, tiny_llama_dir: Path) -> None:
    """The decode node's path: reserve, (KV arrives), attach, commit, then stream tokens 2..N."""
    prompt = list(range(100, 140))
    [expected] = LLM(tiny_llama_dir, dtype="float32", max_model_len=256).generate([prompt], GREEDY)

    async def main() -> list[int]:
        # Here the KV is computed by a prefill inside the same engine instead of pushed: a
        # throwaway hold_kv request fills blocks whose contents the reservation then copies.
        reservation = await engine.call(lambda e: e.reserve("d", prompt, GREEDY))
        assert reservation is not None
        blocks = reservation.block_ids
        first_only = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        first = [out async for out in engine.generate("p", prompt, first_only, hold_kv=True)]

        def copy_kv(e: EngineCore) -> None:
            source = e.kv_block_ids("p")
            for cache in e.kv_caches:
                cache[:, blocks] = cache[:, source]
            e.release_kv("p")

        await engine.call(copy_kv)
        stream = await engine.attach("d")
        first_token = first[0].new_token_ids[0]
        await engine.call(lambda e: e.commit("d", first_token))
        tokens = [first_token]
        async for out in stream:
            tokens.extend(out.new_token_ids)
        return tokens

    assert asyncio.run(main()) == expected.token_ids
    assert engine.engine.stats().num_blocks_used == 0


def test_attach_to_an_unknown_request_fails(engine: AsyncEngine) -> None:
    async def main() -> None:
        with pytest.raises(KeyError, match="not in the engine"):
            await engine.attach("nobody")

    asyncio.run(main())


def test_abort_ends_the_stream_with_finish_reason_abort(engine: AsyncEngine) -> None:
    async def main() -> None:
        params = SamplingParams(max_tokens=500, ignore_eos=True)
        stream = engine.generate("to-abort", list(range(10, 30)), params)
        await stream.__anext__()
        assert await engine.abort("to-abort")
        outputs = [out async for out in stream]
        assert outputs[-1].finish_reason is FinishReason.ABORT
        assert await engine.call(lambda e: e.stats().num_blocks_used) == 0
        assert not await engine.abort("to-abort")

    asyncio.run(main())


def test_a_commit_whose_first_token_stops_ends_the_attached_stream(engine: AsyncEngine) -> None:
    async def main() -> None:
        eos = engine.engine.model_config.eos_token_ids[0]
        assert await engine.call(lambda e: e.reserve("r", [5, 6, 7], SamplingParams(max_tokens=9)))
        stream = await engine.attach("r")
        output = await engine.commit("r", eos)
        assert output.finish_reason is FinishReason.STOP and output.new_token_ids == [eos]
        streamed = [out async for out in stream]
        assert [o.new_token_ids for o in streamed] == [[]]  # tokens 2..N: none
        assert streamed[-1].finish_reason is FinishReason.STOP
        assert await engine.call(lambda e: e.stats().num_blocks_used) == 0

    asyncio.run(main())


def test_a_factory_builds_the_engine_on_the_engine_thread(tiny_llama_dir: Path) -> None:
    built_on: list[str] = []

    def factory() -> EngineCore:
        built_on.append(threading.current_thread().name)
        return make_engine(tiny_llama_dir)

    async_engine = AsyncEngine(factory)
    async_engine.start()  # returns once the engine is built
    try:
        assert built_on == ["engine"]
        assert isinstance(async_engine.engine, EngineCore)
        [expected] = LLM(tiny_llama_dir, dtype="float32", max_model_len=256).generate(
            [[5, 6, 7]], GREEDY
        )
        tokens = asyncio.run(collect(async_engine, "f1", [5, 6, 7], GREEDY))
        assert tokens == expected.token_ids
    finally:
        async_engine.shutdown()


def test_a_failing_factory_fails_start_and_the_engine_refuses_calls() -> None:
    def factory() -> EngineCore:
        raise ValueError("no such model: /nowhere")

    async_engine = AsyncEngine(factory)
    with pytest.raises(ValueError, match="/nowhere"):
        async_engine.start()
    assert not async_engine.is_running
    with pytest.raises(EngineDeadError, match="/nowhere"):
        asyncio.run(async_engine.call(lambda core: core.stats()))


def test_stats_answer_at_once_while_a_step_runs_and_include_what_returned(engine) -> None:
    """``stats`` never waits for the engine thread (a load report must not queue behind a long
    prefill step), and it already counts whatever a returned call or an ended stream did."""
    gate = threading.Event()

    async def main() -> None:
        assert engine.stats.num_blocks_used == 0
        reservation = await engine.reserve("held", list(range(10, 50)), GREEDY)
        assert reservation is not None
        assert engine.stats.num_reserved == 1
        assert engine.stats.num_blocks_used == len(reservation.block_ids)
        busy = asyncio.ensure_future(engine.call(lambda e: gate.wait(5)))
        await asyncio.sleep(0.05)  # the engine thread is inside the busy call now
        assert engine.stats.num_reserved == 1  # answered while the thread is held
        assert not busy.done()
        gate.set()
        await busy
        await engine.abort("held")
        assert engine.stats.num_reserved == engine.stats.num_blocks_used == 0
        tokens = await collect(engine, "streamed", list(range(60, 80)), GREEDY)
        assert len(tokens) == 10
        assert engine.stats.num_blocks_used == 0  # freed before its last output was handed over
        engine.shutdown()
        with pytest.raises(EngineDeadError):
            engine.stats  # noqa: B018

    asyncio.run(main())


def test_on_started_is_called_once_when_a_step_first_schedules_the_request(
    tiny_llama_dir: Path,
) -> None:
    # 16 prompt tokens a step: the 80-token prompt takes 5 steps; "started" comes after the first
    # (a prefill node then tells its decode node the request left its queue), once.
    core = LLM(
        tiny_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory=2 << 20,
        max_num_batched_tokens=16,
    ).engine  # fmt: skip
    engine = AsyncEngine(core)
    engine.start()
    events: list[str] = []
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def main() -> None:
        outputs = engine.generate(
            "s", list(range(10, 90)), params, on_started=lambda: events.append("started")
        )
        async for out in outputs:
            events.append("finished" if out.finish_reason is not None else "output")

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert events == ["started", "finished"]


def test_the_slow_host_knobs_are_validated(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="test_step_slowdown"):
        AsyncEngine(lambda: make_engine(tiny_llama_dir), test_step_slowdown=0.5)

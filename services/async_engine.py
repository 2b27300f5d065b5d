"""Runs an ``EngineCore`` in a thread of its own and serves it to asyncio code (the servicers).

Life cycle:

1. ``start()``       the engine thread builds the engine (when given a factory) and begins its
                     loop: run queued commands, then ``step()`` while there is work, else sleep
                     until the next command.
2. ``generate()``    an async iterator per request: the request is added on the engine thread
                     (input errors surface as ``ValueError`` from the first ``__anext__``) and
                     each step's ``EngineCoreOutput`` is handed to the request's asyncio queue.
                     A consumer that stops early (stream closed, deadline, cancellation — even
                     while its add is still queued) aborts the request: it leaves the batch
                     before the next step and its blocks are freed — except a RESERVED
                     request's, which its owner frees after a fence. ``on_started`` is called
                     (on the caller's loop) once a step has computed part of the prompt: a
                     prefill node tells its decode node that the request left its queue.
                     A constrained request's grammar (``params.guided``) is compiled before the
                     add (and before ``reserve()``'s), in a small pool of its own: a large one
                     takes seconds, which on the engine thread would stall every other request's
                     steps and commits, and on the event loop every stream and RPC. llguidance
                     releases the GIL while it compiles; the compile touches only the grammar
                     tokenizer (locked), and the engine thread receives the finished matcher.
3. ``call(fn)``      runs ``fn(engine)`` on the engine thread between two steps (commit,
                     stats, ...): the engine itself is never touched from two threads.
                     ``reserve()`` is the one such call with its own method: a caller that goes
                     away while it is queued must not leave the blocks it took behind.
4. ``stats``         the engine's counts as of its last step or command, read without waiting:
                     a load report or health poll must never queue behind a long step (a
                     1,536-token prefill on one core took longer than the gateway's 2 s poll,
                     so a busy prefill node looked dead). Refreshed on the engine thread before
                     any output or ``call`` result is handed over, so whoever sees a request
                     end or a call return reads stats that include it.
5. ``shutdown()``    stops the loop; requests still streaming end with finish reason ``abort``.

grpc.aio handlers never block on the engine: they await queues fed by the engine thread through
``loop.call_soon_threadsafe``.

Why a node passes a factory, so that the model is loaded on the engine thread: torch's OpenMP
pool belongs to the OS thread that first runs a parallel op. A model loaded on the main thread
leaves that thread a pool of its own; with the engine thread's pool beside it, libgomp's threads
outnumber the 2 cores here, it throttles its spin-waits, and every parallel op pays a futex
wake-up: a small bf16 add took 20-28 µs instead of 6, and a 64 x 256/64 burst through this class
ran 367-439 output tok/s against 531-566 with the model loaded on the engine thread (the same as
the engine driven from the main thread, offline). The engine thread must stay the one thread
that runs torch ops: everything else goes through ``call``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from services.engine import (
    EngineCore,
    EngineCoreOutput,
    EngineStats,
    FinishReason,
    PoolingParams,
    Reservation,
    SamplingParams,
)
from services.engine.request import RequestStatus
from services.engine.structured_output import GrammarMatcher

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shutdown or a crash in a step)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[EngineCoreOutput | BaseException] = field(default_factory=asyncio.Queue)
    is_added: bool = False
    """Its request entered the engine (set and read on the engine thread only)."""
    on_started: Callable[[], None] | None = None
    """Called once on ``loop`` when a step first scheduled the request (then set to None)."""


class AsyncEngine:
    def __init__(
        self,
        engine: EngineCore | Callable[[], EngineCore],
        *,
        idle_wait_s: float = 0.05,
        test_step_delay_s: float = 0.0,
        test_step_slowdown: float = 1.0,
    ) -> None:
        """``engine``: the engine, or a factory that ``start()`` runs on the engine thread (then
        ``self.engine`` exists once ``start()`` has returned). ``test_step_delay_s`` and
        ``test_step_slowdown`` (testing and benchmarks only) make every step that did work take
        that much longer, or that many times as long: a slow host, simulated."""
        if test_step_delay_s < 0 or test_step_slowdown < 1:
            raise ValueError(
                f"test_step_delay_s must be >= 0 and test_step_slowdown >= 1, got "
                f"{test_step_delay_s} and {test_step_slowdown}"
            )
        self._step_delay_s = test_step_delay_s
        self._step_slowdown = test_step_slowdown
        self._awaiting_start: dict[str, _Stream] = {}  # touched on the engine thread only
        self.engine: EngineCore
        self._factory: Callable[[], EngineCore] | None = None
        self._stats: EngineStats | None = None  # written on the engine thread only
        if isinstance(engine, EngineCore):
            self.engine = engine
            self._stats = engine.stats()  # the thread is not started: no one else touches it
        else:
            self._factory = engine
        self._built = threading.Event()
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # touched on the engine thread only
        self._idle_wait_s = idle_wait_s
        self._stopping = threading.Event()
        # Held while a command is queued and while the thread closes the queue, so that no
        # command can land after the thread's last drain (its caller would wait forever).
        self._submit_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._error: BaseException | None = None
        # Grammar compiles get a pool of their own: queued in the default executor, they would
        # hold up the decode node's KV-transfer waits behind them. Two workers, so one huge
        # grammar does not hold up every small one.
        self._grammar_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")

    def start(self) -> None:
        """Starts the engine thread; with a factory, returns once it has built the engine (and
        raises what the factory raised, the thread then stopped)."""
        self._thread.start()
        if self._factory is not None:
            self._built.wait()
            if self._error is not None:
                raise self._error

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    @property
    def stats(self) -> EngineStats:
        """The snapshot of the last step or command (a frozen dataclass, swapped whole)."""
        if not self.is_running or self._stats is None:
            raise EngineDeadError(f"the engine is not running ({self._error or 'stopped'})")
        return self._stats

    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        """Run ``fn(engine)`` on the engine thread; its result or exception comes back here."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def command() -> None:
            try:
                result = fn(self.engine)
            except BaseException as exc:  # noqa: BLE001 (handed to the caller)
                self._refresh_stats()
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                self._refresh_stats()
                loop.call_soon_threadsafe(_set_result, future, result)

        if not self._submit(command):
            raise EngineDeadError(f"the engine is not running ({self._error or 'stopped'})")
        return await future

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        hold_kv: bool = False,
        on_started: Callable[[], None] | None = None,
        pooling: PoolingParams | None = None,
    ) -> AsyncGenerator[EngineCoreOutput, None]:
        """Each step's output for the request, ending with the one that has a finish reason. An
        async generator: closing it (``contextlib.aclosing``) aborts the request at once.
        ``pooling``: an embedding request (``EngineCore.add_request``): one output, its
        ``embedding``."""
        grammar = await self._compile(params)
        stream = _Stream(asyncio.get_running_loop(), on_started=on_started)

        def add(engine: EngineCore) -> None:
            engine.add_request(
                request_id,
                prompt_token_ids,
                params,
                hold_kv=hold_kv,
                grammar=grammar,
                pooling=pooling,
            )
            self._streams[request_id] = stream
            stream.is_added = True
            if on_started is not None:
                self._awaiting_start[request_id] = stream

        def take_back() -> None:
            if stream.is_added:
                self._abandon_on_engine(request_id)

        try:
            await self.call(add)
        except asyncio.CancelledError:
            # The caller went away while the add was queued (behind a long step): it still runs,
            # so take the request out after it — a held prefill request would keep its blocks.
            self._submit(take_back)
            raise
        async for output in self._drain(request_id, stream):
            yield output

    async def reserve(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> Reservation | None:
        """``EngineCore.reserve`` on the engine thread: the blocks, or None (no room)."""
        grammar = await self._compile(params)
        is_reserved = False  # set and read on the engine thread only

        def reserve_on_engine(engine: EngineCore) -> Reservation | None:
            nonlocal is_reserved
            reservation = engine.reserve(request_id, prompt_token_ids, params, grammar=grammar)
            is_reserved = reservation is not None
            return reservation

        def take_back() -> None:
            if is_reserved:
                self._abort_on_engine(request_id)

        try:
            return await self.call(reserve_on_engine)
        except asyncio.CancelledError:
            # The caller went away while the reservation was queued (behind a long step): it
            # still runs, and nobody holds its blocks — no transfer id was handed out, so no
            # peer can be writing into them and they are freed at once, without a fence.
            self._submit(take_back)
            raise

    async def attach(self, request_id: str) -> AsyncGenerator[EngineCoreOutput, None]:
        """Register for the outputs of a request that entered the engine another way (a decode
        node's reservation) and return their stream. Await it before the commit: once it
        returns, no output can be missed."""
        stream = _Stream(asyncio.get_running_loop())

        def register(engine: EngineCore) -> None:
            if request_id not in engine.scheduler.requests:
                raise KeyError(f"request {request_id!r} is not in the engine")
            self._streams[request_id] = stream

        await self.call(register)
        return self._drain(request_id, stream)

    async def commit(
        self, request_id: str, first_token_id: int, logprobs: dict[int, float] | None = None
    ) -> EngineCoreOutput:
        """``EngineCore.commit`` on the engine thread. The attached stream carries tokens 2..N
        (the first came from the prefill node); if the first token already ends the request,
        the stream gets that finish, without the token."""

        def commit_on_engine(engine: EngineCore) -> EngineCoreOutput:
            output = engine.commit(request_id, first_token_id, logprobs)
            if output.finished:
                self._publish([dataclasses.replace(output, new_token_ids=[], new_logprobs=None)])
            return output

        return await self.call(commit_on_engine)

    async def abort(self, request_id: str) -> bool:
        return await self.call(lambda engine: self._abort_on_engine(request_id))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        self._submit(lambda: None)  # wake the loop
        self._thread.join(timeout_s)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    async def _compile(self, params: SamplingParams) -> GrammarMatcher | None:
        """``params.guided`` compiled in the grammar pool (``ValueError`` naming the field), or
        None for an unconstrained request."""
        if params.guided is None:
            return None
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running ({self._error or 'stopped'})")
        compile_grammar = self.engine.structured_outputs.compile
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._grammar_pool, compile_grammar, params.guided)

    def _submit(self, command: Callable[[], None]) -> bool:
        with self._submit_lock:
            if self._closed or not self._thread.is_alive():
                return False
            self._commands.put(command)
            return True

    async def _drain(
        self, request_id: str, stream: _Stream
    ) -> AsyncGenerator[EngineCoreOutput, None]:
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                # The consumer went away early: free the request at the next command drain.
                self._submit(lambda: self._abandon_on_engine(request_id))

    def _abandon_on_engine(self, request_id: str) -> None:
        """The consumer of a stream went away. A running or waiting request is aborted; a
        RESERVED one only loses its stream: a peer may still be writing into its blocks, so it
        is freed by whoever owns the reservation (the decode node's TransferManager, after a
        fence), never here."""
        request = self.engine.scheduler.requests.get(request_id)
        if request is not None and request.status is RequestStatus.RESERVED:
            self._streams.pop(request_id, None)
            return
        self._abort_on_engine(request_id)

    def _abort_on_engine(self, request_id: str) -> bool:
        """Abort on the engine thread; a stream still being read ends with finish reason abort."""
        found = self.engine.abort(request_id)
        stream = self._streams.pop(request_id, None)
        self._refresh_stats()
        if stream is not None:
            ended = EngineCoreOutput(request_id, [], None, FinishReason.ABORT, 0)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, ended)
        return found

    def _run(self) -> None:
        if self._factory is not None:
            try:
                self.engine = self._factory()
                self._refresh_stats()
            except BaseException as exc:  # noqa: BLE001 (raised again by start())
                self._error = exc
                self._stopping.set()
                with self._submit_lock:
                    self._closed = True
                return
            finally:
                self._built.set()
        try:
            while not self._stopping.is_set():
                self._run_commands(block=not self.engine.has_work)
                self._refresh_stats()  # commands that were not calls (a stream's abandon)
                if self.engine.has_work and not self._stopping.is_set():
                    started = time.monotonic()
                    outputs = self.engine.step()
                    self._notify_started()
                    self._simulate_slow_host(time.monotonic() - started, bool(outputs))
                    self._publish(outputs)
        except BaseException as exc:  # noqa: BLE001 (a crashed step must reach every stream)
            logger.exception("engine loop crashed")
            self._error = exc
        finally:
            self._stopping.set()
            with self._submit_lock:
                self._closed = True
            self._run_commands(block=False)  # everything queued before closing still runs
            self._end_streams()

    def _run_commands(self, *, block: bool) -> None:
        try:
            command = self._commands.get(timeout=self._idle_wait_s) if block else None
            if command is not None:
                _run_logged(command)
            while True:
                _run_logged(self._commands.get_nowait())
        except queue.Empty:
            return

    def _publish(self, outputs: list[EngineCoreOutput]) -> None:
        # One hand-off per loop per step, not one per request: each call_soon_threadsafe wakes
        # the loop and takes the GIL, which the engine thread needs between every op it
        # dispatches (a 64 x 256/64 burst served: 243 -> 274 output tok/s on the same host).
        self._refresh_stats()
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            deliveries.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, items in deliveries.items():
            loop.call_soon_threadsafe(_deliver, items)

    def _notify_started(self) -> None:
        """``on_started`` for each request a step has scheduled (or already finished)."""
        if not self._awaiting_start:
            return
        requests = self.engine.scheduler.requests
        for request_id, stream in list(self._awaiting_start.items()):
            request = requests.get(request_id)
            if request is not None and request.first_scheduled_time is None:
                continue
            del self._awaiting_start[request_id]
            callback, stream.on_started = stream.on_started, None
            if callback is not None:
                stream.loop.call_soon_threadsafe(callback)

    def _simulate_slow_host(self, step_s: float, did_work: bool) -> None:
        # Testing only: sleeping here holds no lock the servicers need (commands wait, as they
        # would behind a slow step).
        if not did_work and step_s < 1e-3:
            return
        extra = self._step_delay_s + (self._step_slowdown - 1.0) * step_s
        if extra > 0:
            self._stopping.wait(extra)

    def _refresh_stats(self) -> None:
        self._stats = self.engine.stats()

    def _end_streams(self) -> None:
        """Every open stream ends: with the crash, or with finish reason abort on shutdown."""
        for request_id, stream in self._streams.items():
            _run_logged(lambda request_id=request_id: self.engine.abort(request_id))
            item: EngineCoreOutput | BaseException = (
                EngineDeadError(f"the engine stopped: {self._error}")
                if self._error is not None
                else EngineCoreOutput(request_id, [], None, FinishReason.ABORT, 0)
            )
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        self._streams.clear()


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for stream_queue, item in items:
        stream_queue.put_nowait(item)


def _run_logged(command: Callable[[], object]) -> None:
    # Commands from call() report their own errors; anything else (an abort) must not stop the
    # loop that every other stream depends on.
    try:
        command()
    except Exception:
        logger.exception("engine command failed")


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)

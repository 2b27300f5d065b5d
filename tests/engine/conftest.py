"""Factories for the engine's bookkeeping units: KV cache manager, scheduler, requests.

Tests take the factory as a fixture and call it: ``scheduler = make_scheduler(num_blocks=8)``.
No torch and no model: these units are pure Python and each test runs in milliseconds.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import NamedTuple

import pytest

from services.engine.config import SchedulerConfig
from services.engine.kv_cache_manager import KVCacheManager
from services.engine.request import Request
from services.engine.scheduler import SampledToken, Scheduler, SchedulerOutput
from services.types import SamplingParams

EOS_TOKEN_ID = 2
"""The EOS id of every scheduler ``make_scheduler`` builds (unless told otherwise)."""
DEFAULT_SAMPLED_TOKEN = 7
"""What ``run_step`` samples when not told: neither EOS nor any prompt token of ``make_request``."""

SampledTokens = int | dict[str, int] | Callable[[Request], int]


class Step(NamedTuple):
    """What one ``run_step`` did."""

    output: SchedulerOutput
    updated: list[Request]
    """What ``update_from_output`` returned: requests that got a token or finished."""
    sampled_ids: list[str]
    """Requests whose chunk needed a sample, in chunk order: those ``run_step`` sampled for."""

    @property
    def chunk_sizes(self) -> dict[str, int]:
        return {chunk.request.request_id: chunk.num_tokens for chunk in self.output.chunks}


def make_kv_manager(
    num_blocks: int = 8, block_size: int = 4, caching: bool = True
) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)


def make_scheduler(
    num_blocks: int = 16,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    policy: str = "fcfs",
    max_model_len: int = 256,
    eos_token_ids: frozenset[int] = frozenset({EOS_TOKEN_ID}),
    caching: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        policy=policy,
    )
    return Scheduler(
        config,
        make_kv_manager(num_blocks, block_size, caching),
        max_model_len=max_model_len,
        eos_token_ids=frozenset(eos_token_ids),
    )


def make_request(
    request_id: str,
    num_tokens: int | None = None,
    *,
    token_ids: list[int] | None = None,
    max_tokens: int = 16,
    priority: int = 0,
    arrival_time: float | None = None,
    **params: object,
) -> Request:
    """A request of ``token_ids``, or of ``num_tokens`` ids unique to ``request_id``.

    Generated prompts of different requests share no token, so they never share a cached block;
    their ids are >= 1000, clear of ``EOS_TOKEN_ID`` and ``DEFAULT_SAMPLED_TOKEN``.
    """
    if (num_tokens is None) == (token_ids is None):
        raise TypeError("give exactly one of num_tokens and token_ids")
    if token_ids is None:
        base = 1000 * (1 + zlib.crc32(request_id.encode()) % 1_000_000)
        token_ids = [base + i for i in range(num_tokens)]
    sampling = SamplingParams(max_tokens=max_tokens, priority=priority, **params)
    request = Request(request_id, list(token_ids), sampling)
    if arrival_time is not None:
        request.arrival_time = arrival_time
    return request


def run_step(scheduler: Scheduler, sampled_token: SampledTokens = DEFAULT_SAMPLED_TOKEN) -> Step:
    """One engine step without a model: schedule, sample for every chunk that needs it, update.

    ``sampled_token`` is one id for every request, a dict by request id (others get the
    default), or a function of the request.
    """
    output = scheduler.schedule()
    sampled = {
        chunk.request.request_id: [SampledToken(_token_for(chunk.request, sampled_token))]
        for chunk in output.chunks
        if chunk.needs_sample
    }
    return Step(output, scheduler.update_from_output(output, sampled), list(sampled))


def drain(
    scheduler: Scheduler, sampled_token: SampledTokens = DEFAULT_SAMPLED_TOKEN, max_steps: int = 200
) -> list[SchedulerOutput]:
    """Step until every request finished; returns the outputs of the steps taken."""
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests:
            return outputs
        step = run_step(scheduler, sampled_token)
        assert not step.output.is_empty, "unfinished requests but nothing scheduled: livelock"
        outputs.append(step.output)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def assert_all_free(kv_manager: KVCacheManager) -> None:
    pool = kv_manager.pool
    held = [block.block_id for block in pool.blocks if block.ref_count != 0]
    assert not held, f"blocks still referenced: {held}"
    assert kv_manager.num_free_blocks == kv_manager.num_blocks
    assert pool.num_used_blocks == 0


def _token_for(request: Request, sampled_token: SampledTokens) -> int:
    if isinstance(sampled_token, int):
        return sampled_token
    if isinstance(sampled_token, dict):
        return sampled_token.get(request.request_id, DEFAULT_SAMPLED_TOKEN)
    return sampled_token(request)


# The factories as fixtures, so that test modules (imported in importlib mode, where a conftest
# is not importable) use them as ``def test_x(make_scheduler, make_request): ...``.


@pytest.fixture(name="make_kv_manager")
def make_kv_manager_fixture() -> Callable[..., KVCacheManager]:
    return make_kv_manager


@pytest.fixture(name="make_scheduler")
def make_scheduler_fixture() -> Callable[..., Scheduler]:
    return make_scheduler


@pytest.fixture(name="make_request")
def make_request_fixture() -> Callable[..., Request]:
    return make_request


@pytest.fixture(name="run_step")
def run_step_fixture() -> Callable[..., Step]:
    return run_step


@pytest.fixture(name="drain")
def drain_fixture() -> Callable[..., list[SchedulerOutput]]:
    return drain


@pytest.fixture(name="assert_all_free")
def assert_all_free_fixture() -> Callable[[KVCacheManager], None]:
    return assert_all_free

"""A node's metrics as Prometheus scrapes them: names, types and values from the engine's stats."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from prometheus_client import generate_latest

from services.async_engine import EngineDeadError
from services.engine.outputs import EngineStats
from services.node.metrics import NodeMetrics

LABELS = {"role": "decode", "node": "d0"}


def make_stats(
    num_preemptions_total: int = 0, num_queried_tokens: int = 0, num_hit_tokens: int = 0
) -> EngineStats:
    return EngineStats(
        num_running=1, num_waiting=0, num_reserved=0, num_held=0, num_blocks_used=5,
        num_blocks_total=10, prefix_cache_queried_tokens=num_queried_tokens,
        prefix_cache_hit_tokens=num_hit_tokens, num_preemptions_total=num_preemptions_total,
    )  # fmt: skip


class _StatsThenDead:
    """An engine whose stats are read once per refresh; it dies after the last snapshot."""

    def __init__(self, snapshots: list[EngineStats]) -> None:
        self._snapshots = list(snapshots)

    @property
    def stats(self) -> EngineStats:
        if not self._snapshots:
            raise EngineDeadError("stopped")
        return self._snapshots.pop(0)


def _refresh(metrics: NodeMetrics, snapshots: list[EngineStats]) -> None:
    engine: Any = _StatsThenDead(snapshots)
    asyncio.run(metrics.refresh_forever(engine, interval_s=0))


def _sample(metrics: NodeMetrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(f"pdserve:{name}", LABELS)


def test_preemptions_are_a_counter_that_follows_the_engine_total() -> None:
    metrics = NodeMetrics("decode", "d0")
    _refresh(metrics, [make_stats(total) for total in (0, 2, 2, 5)])
    assert _sample(metrics, "num_preemptions_total") == 5
    exported = generate_latest(metrics.registry).decode()
    assert "# TYPE pdserve:num_preemptions_total counter" in exported
    # The other engine gauges come from the same snapshot.
    assert _sample(metrics, "kv_cache_usage_perc") == 0.5


def test_the_preemption_counter_never_goes_down() -> None:
    metrics = NodeMetrics("decode", "d0")
    _refresh(metrics, [make_stats(total) for total in (3, 1, 4)])
    assert _sample(metrics, "num_preemptions_total") == 4


def test_prefix_cache_queries_and_hits_are_counters_of_tokens() -> None:
    """vLLM's ``prefix_cache_queries_total`` / ``prefix_cache_hits_total``: rate() of each gives
    the hit rate over a recent window, which the lifetime ratio gauge cannot."""
    metrics = NodeMetrics("decode", "d0")
    _refresh(metrics, [make_stats(0, 0, 0), make_stats(0, 100, 40), make_stats(0, 250, 140)])
    assert _sample(metrics, "prefix_cache_queries_total") == 250
    assert _sample(metrics, "prefix_cache_hits_total") == 140
    assert _sample(metrics, "prefix_cache_hit_rate") == 140 / 250
    exported = generate_latest(metrics.registry).decode()
    assert "# TYPE pdserve:prefix_cache_queries_total counter" in exported
    assert "# TYPE pdserve:prefix_cache_hits_total counter" in exported


def test_speculative_decoding_counts_proposals_verified_and_kept() -> None:
    """vLLM's ``spec_decode_num_draft_tokens`` / ``_num_accepted_tokens``: rate() of the kept
    over rate() of the verified is the recent acceptance rate."""
    metrics = NodeMetrics("decode", "d0")
    snapshots = [
        dataclasses.replace(make_stats(), num_draft_tokens_total=d, num_accepted_tokens_total=a)
        for d, a in ((0, 0), (12, 5), (40, 22))
    ]
    _refresh(metrics, snapshots)
    assert _sample(metrics, "spec_decode_num_draft_tokens_total") == 40
    assert _sample(metrics, "spec_decode_num_accepted_tokens_total") == 22
    exported = generate_latest(metrics.registry).decode()
    assert "# TYPE pdserve:spec_decode_num_accepted_tokens_total counter" in exported


def test_node_metrics_carry_no_created_series() -> None:
    metrics = NodeMetrics("prefill", "p0", transport="loopback")
    metrics.request_finished("stop")
    metrics.kv_transfer_seconds.observe(0.01)
    exported = generate_latest(metrics.registry).decode()
    assert "pdserve:request_success_total{" in exported
    assert "_created" not in exported


def test_lora_requests_info_holds_the_current_adapters_only() -> None:
    """vLLM's ``lora_requests_info``: one series whose labels name the running and the waiting
    requests' adapters; a past label set does not linger beside it."""
    metrics = NodeMetrics("decode", "d0")
    base = make_stats()
    _refresh(metrics, [base])
    assert "pdserve:lora_requests_info{" not in generate_latest(metrics.registry).decode()
    snapshots = [
        dataclasses.replace(base, max_loras=2, lora_running=("a",), lora_waiting=("a", "b")),
        dataclasses.replace(base, max_loras=2, lora_running=("b",), lora_waiting=()),
    ]
    _refresh(metrics, snapshots)
    series = [
        line for line in generate_latest(metrics.registry).decode().splitlines()
        if line.startswith("pdserve:lora_requests_info{")
    ]  # fmt: skip
    assert len(series) == 1, series
    current = {**LABELS, "max_lora": "2", "running_lora_adapters": "b", "waiting_lora_adapters": ""}
    assert metrics.registry.get_sample_value("pdserve:lora_requests_info", current) > 0

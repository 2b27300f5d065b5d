"""A node's metrics as Prometheus scrapes them: names, types and values from the engine's stats."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from prometheus_client import generate_latest

from services.async_engine import EngineDeadError
from services.node.metrics import NodeMetrics

LABELS = {"role": "decode", "node": "d0"}


class _StatsThenDead:
    """An engine whose stats are read once per refresh; it dies after the last snapshot."""

    def __init__(self, preemption_totals: list[int]) -> None:
        self._totals = list(preemption_totals)

    @property
    def stats(self) -> SimpleNamespace:
        if not self._totals:
            raise EngineDeadError("stopped")
        return SimpleNamespace(
            num_running=1, num_waiting=0, num_reserved=0, kv_cache_usage=0.5,
            prefix_cache_hit_rate=0.0, num_preemptions_total=self._totals.pop(0),
        )  # fmt: skip


def _refresh(metrics: NodeMetrics, totals: list[int]) -> None:
    engine: Any = _StatsThenDead(totals)
    asyncio.run(metrics.refresh_forever(engine, interval_s=0))


def test_preemptions_are_a_counter_that_follows_the_engine_total() -> None:
    metrics = NodeMetrics("decode", "d0")
    _refresh(metrics, [0, 2, 2, 5])
    value = metrics.registry.get_sample_value("pdserve:num_preemptions_total", LABELS)
    assert value == 5
    exported = generate_latest(metrics.registry).decode()
    assert "# TYPE pdserve:num_preemptions_total counter" in exported
    # The other engine gauges come from the same snapshot.
    assert metrics.registry.get_sample_value("pdserve:kv_cache_usage_perc", LABELS) == 0.5


def test_the_preemption_counter_never_goes_down() -> None:
    metrics = NodeMetrics("decode", "d0")
    _refresh(metrics, [3, 1, 4])
    assert metrics.registry.get_sample_value("pdserve:num_preemptions_total", LABELS) == 4

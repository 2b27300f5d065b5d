"""A node's Prometheus metrics (design §7), under the ``pdserve:`` prefix vLLM users know.

One ``NodeMetrics`` per node, on its own registry (several nodes can share a test process), every
series labelled by ``role`` and ``node``. Gauges, and the counters that follow the engine's running
totals (preemptions, prefix cache queries and hits), are refreshed from ``EngineStats`` by a
periodic task; latencies, transfer sizes and failures are observed where they happen.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)

from services.async_engine import AsyncEngine, EngineDeadError
from services.engine import EngineStats
from services.listen import ListenError

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_BYTES_BUCKETS = tuple(float(2**k) for k in range(16, 32, 2))  # 64 KiB .. 1 GiB


class _EngineTotal:
    """A counter that follows one of the engine's running totals, read from its stats: it
    advances by what the total gained since the last read and never goes down."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.num_seen = 0

    def advance_to(self, total: int) -> None:
        if total > self.num_seen:
            self.counter.inc(total - self.num_seen)
            self.num_seen = total


class NodeMetrics:
    def __init__(self, role: str, node_id: str, transport: str | None = None) -> None:
        # No ``_created`` series, as on the gateway (gateway/metrics.py says why).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        labels = {"role": role, "node": node_id}
        names = list(labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pdserve:{name}", doc, names, registry=self.registry).labels(**labels)

        def histogram(
            name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS
        ) -> Histogram:
            metric = Histogram(
                f"pdserve:{name}", doc, names, registry=self.registry, buckets=buckets
            )
            return metric.labels(**labels)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be admitted")
        self.num_requests_reserved = gauge(
            "num_requests_reserved", "Decode: requests holding blocks while their KV arrives"
        )
        self.kv_unstarted_reservations = gauge(
            "kv_unstarted_reservations",
            "Decode: KV reservations whose prefill node has not started computing the prompt",
        )
        self.kv_unstarted_blocks = gauge(
            "kv_unstarted_blocks",
            "Decode: KV blocks held by reservations whose prefill has not started",
        )
        self.kv_waiting_reservations = gauge(
            "kv_waiting_reservations", "Decode: KV reservations waiting for room (no blocks held)"
        )
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use")
        self.prefix_cache_hit_rate = gauge(
            "prefix_cache_hit_rate", "Prompt tokens served by the prefix cache / tokens looked up"
        )

        # Counters (exported with _total): rate() over them is meaningful, over a window of the
        # dashboard's choosing, which a lifetime ratio is not.
        def engine_total(name: str, doc: str) -> _EngineTotal:
            counter = Counter(f"pdserve:{name}", doc, names, registry=self.registry)
            return _EngineTotal(counter.labels(**labels))

        self.num_preemptions = engine_total("num_preemptions", "Preemptions since start")
        # vLLM's prefix_cache_queries / prefix_cache_hits: rate(hits) / rate(queries) is the
        # recent hit rate.
        self.prefix_cache_queries = engine_total(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_cache_hits = engine_total(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache"
        )
        # vLLM's spec_decode_num_draft_tokens / _num_accepted_tokens: their rates' ratio is
        # the recent acceptance rate of speculative decoding's proposals.
        self.spec_decode_draft_tokens = engine_total(
            "spec_decode_num_draft_tokens", "Proposed tokens verified (speculative decoding)"
        )
        self.spec_decode_accepted_tokens = engine_total(
            "spec_decode_num_accepted_tokens", "Proposed tokens kept (speculative decoding)"
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Request arrival to first token"
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Request arrival to its last token"
        )
        self.requests_finished = Counter(
            "pdserve:request_success", "Finished requests by finish reason",
            [*names, "finished_reason"], registry=self.registry,
        )  # fmt: skip
        self._labels = labels
        self.lora_requests_info = Gauge(
            "pdserve:lora_requests_info", "vLLM's: the LoRA adapters of the running and the "
            "waiting requests (comma-separated labels), and max_loras; the value is the time of "
            "the last refresh. Only with LoRA on.",
            [*names, "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=self.registry,
        )  # fmt: skip
        self._lora_info: tuple[str, str, str] | None = None
        transfer_labels = [*names, "transport"]
        self.kv_transfer_seconds = Histogram(
            "pdserve:kv_transfer_seconds", "Time to push one request's KV pages",
            transfer_labels, registry=self.registry, buckets=_LATENCY_BUCKETS,
        ).labels(**labels, transport=transport or "none")  # fmt: skip
        self.kv_transfer_bytes = Histogram(
            "pdserve:kv_transfer_bytes", "Bytes of one request's KV pages",
            transfer_labels, registry=self.registry, buckets=_BYTES_BUCKETS,
        ).labels(**labels, transport=transport or "none")  # fmt: skip
        self.kv_transfer_failures = Counter(
            "pdserve:kv_transfer_failures", "KV transfers that did not complete, by reason",
            [*transfer_labels, "reason"], registry=self.registry,
        )  # fmt: skip
        self.kv_recomputes = Counter(
            "pdserve:kv_recomputes", "Decode: prompts recomputed locally after a failed KV "
            "handoff (on_kv_failure=recompute), by cause",
            [*transfer_labels, "cause"], registry=self.registry,
        )  # fmt: skip
        self._transport = transport or "none"
        self.kv_transport_info = Gauge(
            "pdserve:kv_transport_info", "The KV transport and lanes the self-test found (1)",
            [*transfer_labels, "lanes"], registry=self.registry,
        )  # fmt: skip

        self.gemm_gflops = Gauge(
            "pdserve:gemm_gflops", "GEMM rate measured at start-up at this model's shapes, "
            "GFLOP/s, per dtype (none when the dtype was given)",
            [*names, "dtype"], registry=self.registry,
        )  # fmt: skip
        self.compute_dtype_info = Gauge(
            "pdserve:compute_dtype_info", "The dtype the engine computes in (1), and how it "
            "was chosen: explicit, cuda default, quantized checkpoint, cached or measured",
            [*names, "dtype", "source"], registry=self.registry,
        )  # fmt: skip
        self.kv_cache_dtype_info = Gauge(
            "pdserve:kv_cache_dtype_info", "The dtype the KV cache holds (1), and how it was "
            "chosen: explicit, cpu default (bfloat16) or compute dtype",
            [*names, "dtype", "source"], registry=self.registry,
        )  # fmt: skip

    def kv_cache_dtype(self, dtype: str, source: str) -> None:
        self.kv_cache_dtype_info.labels(**self._labels, dtype=dtype, source=source).set(1)

    def compute_dtype(self, dtype: str, source: str, gflops: Mapping[str, float]) -> None:
        self.compute_dtype_info.labels(**self._labels, dtype=dtype, source=source).set(1)
        for name, rate in gflops.items():
            self.gemm_gflops.labels(**self._labels, dtype=name).set(rate)

    def request_finished(self, reason: str) -> None:
        self.requests_finished.labels(**self._labels, finished_reason=reason).inc()

    def transfer_failed(self, reason: str) -> None:
        self.kv_transfer_failures.labels(
            **self._labels, transport=self._transport, reason=reason
        ).inc()

    def kv_recomputed(self, cause: str) -> None:
        self.kv_recomputes.labels(**self._labels, transport=self._transport, cause=cause).inc()

    def transport_lanes(self, lanes: list[str]) -> None:
        self.kv_transport_info.labels(
            **self._labels, transport=self._transport, lanes=",".join(lanes)
        ).set(1)

    def serve(self, port: int) -> None:
        try:
            start_http_server(port, registry=self.registry)
        except OSError as exc:
            raise ListenError(f"cannot listen for metrics on :{port}: {exc.strerror}") from exc
        logger.info("metrics on :%d/metrics", port)

    async def refresh_forever(self, engine: AsyncEngine, interval_s: float = 0.5) -> None:
        while True:
            try:
                stats = engine.stats
            except EngineDeadError:
                return
            self.num_requests_running.set(stats.num_running)
            self.num_requests_waiting.set(stats.num_waiting)
            self.num_requests_reserved.set(stats.num_reserved)
            self.kv_cache_usage_perc.set(stats.kv_cache_usage)
            self.prefix_cache_hit_rate.set(stats.prefix_cache_hit_rate)
            self.num_preemptions.advance_to(stats.num_preemptions_total)
            self.prefix_cache_queries.advance_to(stats.prefix_cache_queried_tokens)
            self.prefix_cache_hits.advance_to(stats.prefix_cache_hit_tokens)
            self.spec_decode_draft_tokens.advance_to(stats.num_draft_tokens_total)
            self.spec_decode_accepted_tokens.advance_to(stats.num_accepted_tokens_total)
            if stats.max_loras:
                self._refresh_lora_info(stats)
            await asyncio.sleep(interval_s)

    def _refresh_lora_info(self, stats: EngineStats) -> None:
        """One series, the current one: vLLM's keeps every past label set, which a query of
        the gauge then sees beside the current."""
        info = (str(stats.max_loras), ",".join(stats.lora_running), ",".join(stats.lora_waiting))
        if self._lora_info is not None and info != self._lora_info:
            self.lora_requests_info.remove(*self._labels.values(), *self._lora_info)
        self._lora_info = info
        max_lora, running, waiting = info
        self.lora_requests_info.labels(
            **self._labels, max_lora=max_lora, running_lora_adapters=running,
            waiting_lora_adapters=waiting,
        ).set_to_current_time()  # fmt: skip

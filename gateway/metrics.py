"""The gateway's Prometheus metrics (design §7), under the ``pdserve:`` prefix.

Latencies are observed where tokens leave for the client: TTFT from arrival to the first token,
ITL between token chunks, e2e to the last; stage timings come from the nodes' ``Finished``.
Served on the HTTP port's ``/metrics``; one registry per gateway so tests can run several.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_STAGES = (
    "gateway_queue",
    "prefill_queue",
    "prefill_compute",
    "kv_transfer",
    "decode_queue",
    "first_decode_step",
    "decode",
)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()

        def histogram(name: str, doc: str, labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(
                f"pdserve:{name}", doc, labels, registry=registry, buckets=_LATENCY_BUCKETS
            )

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Gateway arrival to the first token sent"
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Gap between two token chunks of a stream"
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Gateway arrival to the last token"
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Time waiting for an admission slot in the gateway"
        )
        self.stage_seconds = histogram(
            "request_stage_seconds", "Per-stage time of finished requests", ("stage",)
        )
        self.requests_finished = Counter(
            "pdserve:request_success", "Finished requests by finish reason",
            ("finished_reason",), registry=registry,
        )  # fmt: skip
        self.request_errors = Counter(
            "pdserve:request_errors", "Requests refused or failed, by reason",
            ("reason",), registry=registry,
        )  # fmt: skip
        self.retries = Counter(
            "pdserve:request_retries", "Attempts retried on another node, by cause",
            ("cause",), registry=registry,
        )  # fmt: skip
        self.attempts = Counter(
            "pdserve:request_attempts", "Attempts sent to nodes, by route: disaggregated, "
            "local_prefill (a short prompt prefilled on its decode node) or colocated",
            ("route",), registry=registry,
        )  # fmt: skip
        self.num_requests_running = Gauge(
            "pdserve:num_requests_running", "Requests holding an admission slot", registry=registry
        )
        self.num_requests_waiting = Gauge(
            "pdserve:num_requests_waiting", "Requests queued for a slot", registry=registry
        )
        self.healthy_nodes = Gauge(
            "pdserve:healthy_nodes", "Nodes passing health checks, by role", ("role",),
            registry=registry,
        )  # fmt: skip

    def observe_stages(self, timings: object) -> None:
        """``timings``: a ``StageTimings``; stages that did not run (0 s) are not observed."""
        for stage in _STAGES:
            seconds = getattr(timings, f"{stage}_s")
            if seconds > 0:
                self.stage_seconds.labels(stage=stage).observe(seconds)

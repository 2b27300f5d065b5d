"""The gateway's Prometheus metrics (design §7), under the ``pdserve:`` prefix.

Latencies are observed where tokens leave for the client: TTFT from arrival to the first token,
ITL between token chunks, e2e to the last; stage timings come from the nodes' ``Finished``.
Served on the HTTP port's ``/metrics``; one registry per gateway so tests can run several.

Every generation that finishes, whatever ended it (EOS, a stop token or a stop string,
``max_tokens``, an abort or an error after its first token), is counted once in
``request_success{finished_reason}``, ``e2e_request_latency`` and ``request_stage_seconds`` by
the routed generator, under the finish reason the client is told (``stop`` for a stop string
that text held back until the end completes, even where ``max_tokens`` ended the nodes' work),
and its usage in ``prompt_tokens`` and ``generation_tokens``.
A stop string ends the generation before the nodes do: its legs are cancelled before the decode
node's ``Finished``, so the stages only that ``Finished`` reports (``decode_queue``,
``first_decode_step``, ``decode``, and the prefill stages of a node that prefilled the prompt
itself: colocated, local prefill, recompute) are not observed for it; ``gateway_queue`` and a
prefill node's stages (``prefill_queue``, ``prefill_compute``, ``kv_transfer``, from its reply)
are. A request whose client went away is not finished: it counts in ``request_errors`` (HTTP),
never in ``request_success``.

``request_errors{reason}`` counts each failed request once, by the front end that answers it
(per HTTP request, whatever its ``n``), under its most specific reason:

- a refusal before any output, a ``GatewayError``'s ``reason``: its kind (``invalid_argument``,
  ``unauthenticated``, ``not_found``, ``request_timeout``, ``payload_too_large``,
  ``resource_exhausted``: the admission queue or a key's limits, ``unavailable``,
  ``deadline_exceeded``: the deadline passed before the first token), or ``no_node`` (503: no
  healthy pair or colocated node could serve it) or ``no_capacity`` (429: every decode node
  tried was full, its wait queue too); a gRPC request whose bytes do not parse is refused
  before any servicer, by the shared interceptor, and counted by the server as
  ``invalid_argument`` too;
- a generation that ended early after it began (``stream_failure``): ``stream_error`` (finish
  reason ``error``: a node failed mid-stream), ``invalid_argument`` (finish reason ``error``
  for the request's own fault: its grammar failed while it ran) or ``stream_abort``
  (``abort``: the request deadline passed, or a node aborted it);
- HTTP only: ``client_disconnected``, ``slow_client`` (``--client-send-timeout-s``) and
  ``internal`` (a bug in the gateway).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from services.types import FinishReason

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
        # No ``_created`` series beside each counter and histogram (vLLM's V0 engine metrics
        # turned them off the same way, vllm/engine/metrics.py): they double the series scraped
        # and rate() needs none. The switch is prometheus_client's, for the whole process.
        disable_created_metrics()  # type: ignore[no-untyped-call]
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
            "pdserve:request_success", "Finished requests by finish reason (stop: EOS, a stop "
            "token or a stop string)",
            ("finished_reason",), registry=registry,
        )  # fmt: skip
        self.request_errors = Counter(
            "pdserve:request_errors", "Requests refused or failed, each once, by its most "
            "specific reason (the list: gateway/metrics.py)",
            ("reason",), registry=registry,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "pdserve:prompt_tokens", "Prompt tokens of finished generations (once per choice, "
            "cached ones included)", registry=registry,
        )  # fmt: skip
        self.generation_tokens = Counter(
            "pdserve:generation_tokens", "Tokens generated by finished generations",
            registry=registry,
        )  # fmt: skip
        self.retries = Counter(
            "pdserve:request_retries", "Attempts retried on another node, by cause",
            ("cause",), registry=registry,
        )  # fmt: skip
        self.attempts = Counter(
            "pdserve:request_attempts", "Attempts sent to nodes, by route: disaggregated, "
            "prefill_only (a request ending at its first token), local_prefill (a short prompt "
            "prefilled on its decode node) or colocated",
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
        self.responses_stored = Gauge(
            "pdserve:responses_stored", "Responses API responses kept for previous_response_id",
            registry=registry,
        )  # fmt: skip
        self.responses_stored_chars = Gauge(
            "pdserve:responses_stored_chars",
            "Characters of conversation text the stored responses hold (the store's memory)",
            registry=registry,
        )

    def observe_stages(self, timings: object) -> None:
        """``timings``: a ``StageTimings``; stages that did not run (0 s) are not observed."""
        for stage in _STAGES:
            seconds = getattr(timings, f"{stage}_s")
            if seconds > 0:
                self.stage_seconds.labels(stage=stage).observe(seconds)


def stream_failure(finish_reason: FinishReason, invalid_request: bool = False) -> str | None:
    """The ``request_errors`` reason of a generation that ended ``finish_reason`` after it began
    (``invalid_request``: the request's own fault, ``Finished.invalid_request``); None for an end
    that is no failure (``stop``, ``length``)."""
    if finish_reason is FinishReason.ERROR:
        return "invalid_argument" if invalid_request else "stream_error"
    if finish_reason is FinishReason.ABORT:
        return "stream_abort"
    return None

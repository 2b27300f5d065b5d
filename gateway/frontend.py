"""Everything an API front end (OpenAI HTTP, public gRPC) needs, built once by the gateway's
entry point and handed to both: they share one tokenizer, one router-backed generator, one
admission bound and one set of metrics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from gateway.admission import TOKENIZER_SLOTS, Admission
from gateway.auth import ApiKeys
from gateway.embedding import Embedder
from gateway.generation import Generator
from gateway.key_limiter import KeyLimiter
from gateway.limits import RequestLimits
from gateway.metrics import GatewayMetrics
from gateway.reasoning import ReasoningParser
from gateway.routing.lora_updates import LoraUpdates
from gateway.routing.node_census import NodeCensus
from gateway.sampling_defaults import SamplingDefaults
from gateway.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class Frontend:
    served_model_name: str
    """The model id responses carry; a request naming neither it nor an alias is 404."""
    tokenizer: Tokenizer
    generator: Generator
    admission: Admission
    api_keys: ApiKeys
    limits: RequestLimits
    metrics: GatewayMetrics
    node_census: Callable[[], NodeCensus]
    """The node pool's counts now: readiness and the ``/health`` body come from one call."""
    tokenizer_admission: Admission = field(default_factory=lambda: Admission(TOKENIZER_SLOTS, 64))
    """Bounds ``/tokenize`` and ``/detokenize``, which tokenize in threads outside
    ``admission`` (a generation holds its slot for its whole stream; a tokenize call must not
    wait behind one): at most ``TOKENIZER_SLOTS`` at once, then a bounded queue, then 429."""
    request_timeout_s: float | None = 600.0
    """Deadline of one request from its arrival; None: no deadline."""
    client_send_timeout_s: float | None = 30.0
    """Longest one send to an HTTP client may wait for its socket to drain before the request
    is aborted (a client that stopped reading); None: no bound."""
    key_limiter: KeyLimiter = field(default_factory=lambda: KeyLimiter(CollectorRegistry()))
    """Per-key limits of the keys in ``api_keys``; the gateway gives it its metrics registry."""
    reasoning_parser: ReasoningParser | None = None
    """``--reasoning-parser``: chat completions split reasoning from content; None: they do not."""
    tool_call_parser: str | None = None
    """``--tool-call-parser``: the tool-call syntax to parse (``tool_parsers.make_parser``);
    None: the family the vocabulary's marker tokens name."""
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    """The model's sampling defaults (``--generation-config``): what unset fields take."""
    served_model_aliases: tuple[str, ...] = ()
    """Further names a request may give the model (``--served-model-name a b``)."""
    lora_modules: tuple[str, ...] = ()
    """LoRA adapters a request may name as its model (``--lora-modules``) until a node has
    reported its own (``node_lora_names``)."""
    node_lora_names: Callable[[], frozenset[str] | None] = lambda: None
    """The LoRA adapters the nodes reported last (loaded at start-up or at run time); None
    while no node has reported."""
    embedder: Embedder | None = None
    """Computes ``/v1/embeddings``' vectors on the nodes; None: that route answers 404."""
    lora_updates: LoraUpdates | None = None
    """Run-time LoRA loads and unloads on every node (``--allow-runtime-lora-updating``);
    None: off, and their routes do not exist."""
    responses_store_size: int = 1024
    """``--responses-store-size``: Responses API responses kept for ``previous_response_id``
    and ``GET /v1/responses/{id}`` (``http_api/response_store.py``); 0: none."""

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every name of the model, the one responses carry first (``GET /v1/models``)."""
        return (self.served_model_name, *self.served_model_aliases)

    @property
    def lora_names(self) -> tuple[str, ...]:
        """The LoRA adapters a request may name as its model: those the nodes report (so
        adapters loaded or unloaded at run time, through any gateway, are seen at the next
        poll), or ``--lora-modules`` before any node has reported. A name of the base model
        always means the base model."""
        reported = self.node_lora_names()
        names = self.lora_modules if reported is None else tuple(sorted(reported))
        return tuple(name for name in names if name not in self.served_model_names)

    @property
    def model_names(self) -> tuple[str, ...]:
        """What a request's model may be: the base model's names, then the LoRA adapters'."""
        return (*self.served_model_names, *self.lora_names)

    def lora_name(self, model: str | None) -> str | None:
        """The LoRA adapter a request naming ``model`` runs with; None: the base model."""
        return model if model is not None and model in self.lora_names else None

    def response_model(self, model: str | None) -> str:
        """The model a response names: the adapter a request named, else the base model's
        first name (as vLLM's)."""
        return self.lora_name(model) or self.served_model_name

    def is_ready(self) -> bool:
        """True while at least one healthy prefill+decode pair or colocated node is available."""
        return self.node_census().is_ready

"""The gateway's configuration: flags with ``PDSERVE_*`` environment fallbacks, parsed once into
a frozen ``GatewayConfig``; the router, the limits and the servers each get only their part.

Node lists are comma-separated ``host:port`` lists (``--prefill a:50061,b:50061``, or
``PDSERVE_PREFILL``); an entry ``dns:///name:port`` stands for every address the name resolves
to, re-resolved every health interval (``gateway.routing.node_discovery``). API keys: ``--api-key``
(repeatable; ``PDSERVE_API_KEY`` is one key) or ``PDSERVE_API_KEYS=k1,k2``, and ``--api-key-file``
(names and per-key limits). An empty key is refused, never taken as "no authentication": an unset
shell variable in ``--api-key "$KEY"`` must not open the API.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.api_key_file import load_api_key_file
from gateway.auth import ApiKey, ApiKeys
from gateway.limits import RequestLimits
from gateway.reasoning import ReasoningParser
from gateway.sampling_defaults import SamplingDefaults, load_sampling_defaults
from gateway.tool_parsers import PARSERS
from services.cli import (
    ENV_PREFIX,
    AppendOverDefault,
    apply_env_defaults,
    finite_float,
    join_negative_sizes,
    parse_bytes,
    parse_json_object,
)
from services.models.config import text_model_config, with_overrides
from services.models.gguf_file import find_gguf, open_gguf
from services.tls import EdgeTlsFiles, TlsFiles, add_tls_flags, tls_from_args

_ADDRESS = re.compile(r"^(dns:///)?[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")
_JINJA_CHARS = "{}\n"
"""What tells an inline ``--chat-template`` from a path (vLLM's test): no real path holds them."""
MAX_LEASE_MS = 2**32 - 1
"""``lease_ms`` travels as a proto ``uint32``: a larger value fails every request."""


class KvFailurePolicy:
    FAIL = "fail"
    RECOMPUTE = "recompute"
    ALL = (FAIL, RECOMPUTE)


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    colocated: tuple[str, ...]
    max_retries: int = 2
    """Further pairs tried when a node refuses or fails before anything reached the client."""
    on_kv_failure: str = KvFailurePolicy.FAIL
    """What a decode node does when the KV push fails: end the attempt, or recompute itself."""
    lease_ms: int = 30_000
    """How long a decode reservation waits for its commit (capped by the request deadline)."""
    health_interval_s: float = 1.0
    """Period of the grpc.health.v1 + GetLoad poll of every node."""
    health_timeout_s: float = 2.0
    affinity_block_size: int = 16
    """Tokens per block of the prefix-affinity index (a routing hint, need not match the nodes)."""
    affinity_max_imbalance: int = 4
    """A prefix-affine prefill node is skipped when its queue is this much deeper than the
    least loaded one's."""
    local_prefill_max_tokens: int = 0
    """Conditional disaggregation: a prompt of at most this many tokens is prefilled by its
    decode node, with no prefill node and no KV handoff. 0: every prompt goes to a prefill node."""

    def __post_init__(self) -> None:
        for role in ("prefill", "decode", "colocated"):
            for address in getattr(self, role):
                if not _ADDRESS.match(address):
                    raise ValueError(f"--{role}: {address!r} is not host:port or dns:///name:port")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("--prefill and --decode must be given together (a pair needs both)")
        if not (self.decode or self.colocated):
            raise ValueError("no nodes: give --prefill and --decode, or --colocated")
        if self.max_retries < 0:
            raise ValueError(f"--max-retries must be >= 0, got {self.max_retries}")
        if self.on_kv_failure not in KvFailurePolicy.ALL:
            raise ValueError(f"--on-kv-failure must be one of {', '.join(KvFailurePolicy.ALL)}")
        if not 100 <= self.lease_ms <= MAX_LEASE_MS:
            raise ValueError(f"--lease-ms must be in [100, {MAX_LEASE_MS}], got {self.lease_ms}")
        # not (x > 0) rather than x <= 0: NaN compares false either way and must fail.
        if not (math.isfinite(self.health_interval_s) and self.health_interval_s > 0):
            raise ValueError(f"--health-interval-s must be > 0, got {self.health_interval_s}")
        if not (math.isfinite(self.health_timeout_s) and self.health_timeout_s > 0):
            raise ValueError(f"health_timeout_s must be > 0, got {self.health_timeout_s}")
        if self.affinity_block_size < 1:
            raise ValueError(f"affinity_block_size must be >= 1, got {self.affinity_block_size}")
        if self.affinity_max_imbalance < 0:
            raise ValueError(
                f"affinity_max_imbalance must be >= 0, got {self.affinity_max_imbalance}"
            )
        if self.local_prefill_max_tokens < 0:
            raise ValueError(
                f"--local-prefill-max-tokens must be >= 0, got {self.local_prefill_max_tokens}"
            )


@dataclass(frozen=True)
class CorsConfig:
    """Cross-origin access to the HTTP API from browsers (vLLM's flags and defaults): Starlette's
    ``CORSMiddleware``, which answers preflights before the API key is asked for."""

    allowed_origins: tuple[str, ...] = ("*",)
    """Origins whose pages may call the API; ``*``: any."""
    allowed_methods: tuple[str, ...] = ("*",)
    """Methods a preflight may ask for; ``*``: any."""
    allowed_headers: tuple[str, ...] = ("*",)
    """Request headers a preflight may ask for (``Authorization``, ``Content-Type``); ``*``: any."""
    allow_credentials: bool = False
    """Whether a page may send cookies and HTTP auth with its requests."""

    def __post_init__(self) -> None:
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            values = getattr(self, name)
            if not all(isinstance(value, str) and value.strip() for value in values):
                raise ValueError(f"{name} must be non-empty strings, got {list(values)}")


@dataclass(frozen=True)
class GatewayConfig:
    model_dir: Path
    """Tokenizer, chat template and config.json come from here (no weights are read)."""
    served_model_name: str
    """The name responses carry; requests may name it or any of ``served_model_aliases``."""
    host: str
    http_port: int
    grpc_port: int
    api_keys: tuple[str | ApiKey, ...] = field(repr=False)
    """From ``--api-key`` (unnamed, unlimited) and ``--api-key-file`` (named, with limits)."""
    max_concurrent_requests: int
    max_queued_requests: int
    request_timeout_s: float | None
    limits: RequestLimits
    router: RouterConfig
    log_level: str = "info"
    client_send_timeout_s: float | None = 30.0
    """Longest one send to an HTTP client may wait for its socket to drain; None: no bound."""
    tls: TlsFiles | None = None
    """Mutual TLS to the nodes (``services/tls.py``); None: plaintext."""
    public_tls: EdgeTlsFiles | None = None
    """TLS on the public HTTP and gRPC ports; None: plaintext."""
    reasoning_parser: ReasoningParser | None = None
    """How chat completions split a thinking model's reasoning from its answer; None: not."""
    tool_call_parser: str | None = None
    """``--tool-call-parser``: the tool-call syntax parsed out of a chat's text (a key of
    ``tool_parsers.PARSERS``); None: the family the vocabulary's marker tokens name."""
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    """What a request's unset sampling fields take (``--generation-config``)."""
    served_model_aliases: tuple[str, ...] = ()
    """``--served-model-name``'s further names (vLLM's): accepted, and listed by ``/v1/models``."""
    cors: CorsConfig = field(default_factory=CorsConfig)
    """Which browser pages may call the HTTP API (``--allowed-origins`` and the like)."""
    chat_template: str | None = field(default=None, repr=False)
    """``--chat-template``'s Jinja source, rendered in place of the model's for every chat
    input; None: the model's. Compiled and tried when the tokenizer loads (``Tokenizer``)."""
    lora_modules: tuple[str, ...] = ()
    """``--lora-modules``' names: a request naming one as its model runs with that LoRA
    adapter, which the nodes loaded under the same name (their ``--lora-modules``). Once the
    nodes report, their adapters are what the gateway serves."""
    allow_runtime_lora_updating: bool = False
    """vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: ``/v1/load_lora_adapter`` and
    ``/v1/unload_lora_adapter`` exist and reach every node."""
    responses_store_size: int = 1024
    """Responses API responses kept in memory (``previous_response_id``, ``GET`` and ``DELETE
    /v1/responses/{id}``), least recently used evicted first; 0: none."""

    def __post_init__(self) -> None:
        names = (self.served_model_name, *self.served_model_aliases)
        if not all(name.strip() for name in names) or len(set(names)) != len(names):
            raise ValueError(
                f"--served-model-name: names must be non-blank and distinct, got {list(names)}"
            )
        every = (*names, *self.lora_modules)
        if not all(name.strip() for name in self.lora_modules) or len(set(every)) != len(every):
            raise ValueError(
                "--lora-modules: names must be non-blank and distinct from each other and from "
                f"--served-model-name, got {list(self.lora_modules)}"
            )
        for name in ("http_port", "grpc_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 65535], got {port}")
        if self.max_concurrent_requests < 1:
            raise ValueError(
                f"--max-concurrent-requests must be >= 1, got {self.max_concurrent_requests}"
            )
        if self.responses_store_size < 0:
            raise ValueError(
                f"--responses-store-size must be >= 0 (0: none), got {self.responses_store_size}"
            )
        if self.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests must be >= 0, got {self.max_queued_requests}")
        for name in ("request_timeout_s", "client_send_timeout_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                flag = f"--{name.replace('_', '-')}"
                raise ValueError(f"{flag} must be >= 0 (0: none), got {value}")
        ApiKeys(self.api_keys)  # raises for two keys with one name or one key under two names


def _addresses(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _api_key(text: str) -> str:
    """One ``--api-key``. The message never shows the key: it may be a real one mistyped."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "empty API key (an unset variable?); omit --api-key to serve without authentication"
        )
    if text != text.strip():
        # The server strips the token it receives: such a key could never match.
        raise argparse.ArgumentTypeError("the API key has surrounding spaces")
    return text


def _env_api_keys(environ: Mapping[str, str]) -> tuple[str, ...]:
    """``PDSERVE_API_KEYS=k1,k2``; set but naming no key is an error, not "no authentication"."""
    raw = environ.get(f"{ENV_PREFIX}API_KEYS")
    if raw is None:
        return ()
    keys = _addresses(raw)
    if not keys:
        raise ValueError(
            f"{ENV_PREFIX}API_KEYS is set but names no key; unset it to serve without "
            "authentication"
        )
    return keys


def _string_list(text: str) -> tuple[str, ...]:
    """vLLM's JSON list (``'["https://a.example"]'``), or this project's comma-separated list
    (``https://a.example,https://b.example``, as an environment variable or a topology value
    reads more easily)."""
    if not text.lstrip().startswith("["):
        return _addresses(text)
    try:
        values = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a JSON list: {text!r}") from None
    if not isinstance(values, list) or not all(isinstance(value, str) for value in values):
        raise argparse.ArgumentTypeError(f"not a JSON list of strings: {text!r}")
    return tuple(values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gateway",
        description=f"pdserve gateway: flags fall back to {ENV_PREFIX}<FLAG> variables",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add(
        "--model",
        type=Path,
        default=Path("models/tiny-llama"),
        help="Hugging Face model dir (tokenizer, chat template, config.json) or GGUF file",
    )
    add(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model id(s) clients use (default: the model dir's name); with several (env: "
        "comma-separated), requests may name any and responses carry the first",
    )
    add(
        "--lora-modules",
        nargs="+",
        default=(),
        metavar="NAME[=PATH]",
        help="LoRA adapters the nodes load (their --lora-modules): a request naming NAME as its "
        "model runs with it (a PATH is taken, for the nodes' spelling, and not read); once "
        "the nodes report, the adapters they loaded are served",
    )
    add(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's) load and unload "
        "LoRA adapters on every node (started with --enable-lora) while serving; they read "
        "any path the client names on the nodes' hosts: use with --api-key(-file)",
    )
    add(
        "--responses-store-size",
        type=int,
        default=1024,
        help="/v1/responses: responses kept in this gateway's memory for previous_response_id "
        "and GET/DELETE /v1/responses/{id} (least recently used evicted first; a request's "
        "store: false keeps its own out); 0: none",
    )
    add("--host", default="0.0.0.0", help="address both servers bind")
    add("--http-port", type=int, default=8000, help="OpenAI API, /health, /metrics")
    add("--grpc-port", type=int, default=50051, help="public gRPC API")
    add("--prefill", type=_addresses, default=(), help="prefill nodes, host:port,...")
    add("--decode", type=_addresses, default=(), help="decode nodes, host:port,...")
    add("--colocated", type=_addresses, default=(), help="colocated nodes, host:port,...")
    add(
        "--api-key",
        action=AppendOverDefault,
        type=_api_key,
        default=None,
        help="accept this API key (repeatable; env PDSERVE_API_KEY is one key, PDSERVE_API_KEYS="
        "k1,k2 several); unset: no auth; an empty key is refused",
    )
    add(
        "--api-key-file",
        type=Path,
        default=None,
        help="YAML file of API keys with names and per-key limits (see gateway/api_key_file.py)",
    )
    add("--max-concurrent-requests", type=int, default=256)
    add(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests waiting for a slot beyond this are refused with 429",
    )
    add(
        "--max-model-len",
        type=int,
        default=None,
        help="at most the model's max_position_embeddings, which is the default",
    )
    add(
        "--hf-overrides",
        type=parse_json_object,
        default=None,
        metavar="JSON",
        help="vLLM's: values that replace the model's config.json ones, as the nodes' "
        "--hf-overrides (the gateway reads max_position_embeddings)",
    )
    add(
        "--max-tokens-limit",
        type=int,
        default=None,
        help="largest max_tokens a request may ask (default: max_model_len)",
    )
    add("--max-body-bytes", type=parse_bytes, default=4 * 2**20)
    add(
        "--body-read-timeout-s",
        type=finite_float,
        default=30.0,
        help="an HTTP request body with no new byte for this long is answered 408; 0: never",
    )
    add("--request-timeout-s", type=finite_float, default=600.0, help="0: no deadline")
    add(
        "--client-send-timeout-s",
        type=finite_float,
        default=30.0,
        help="abort a request whose client reads nothing this long with its buffers full; 0: never",
    )
    add("--max-retries", type=int, default=2)
    add("--on-kv-failure", default=KvFailurePolicy.FAIL, choices=KvFailurePolicy.ALL)
    add(
        "--lease-ms",
        type=int,
        default=30_000,
        help=f"how long a decode reservation waits for its KV, in [100, {MAX_LEASE_MS}]",
    )
    add(
        "--local-prefill-max-tokens",
        type=int,
        default=0,
        help="prompts of at most this many tokens are prefilled on their decode node (no KV "
        "handoff); 0: all go to a prefill node",
    )
    add("--health-interval-s", type=finite_float, default=1.0)
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add(
        "--reasoning-parser",
        default=None,
        choices=[parser.value for parser in ReasoningParser],
        help="chat completions return a thinking model's <think> text as reasoning_content: "
        "qwen3 (the model opens <think>), deepseek_r1 (the template does); default: none",
    )
    add(
        "--tool-call-parser",
        default="auto",
        choices=["auto", *PARSERS],
        help="the tool-call syntax chat completions parse from the model's text with "
        "tool_choice auto: hermes (<tool_call> JSON), mistral ([TOOL_CALLS]), llama3_json, "
        "pythonic ([f(a=1), g()]; Llama 3.2/4's pythonic templates); auto: the family whose "
        "marker token the vocabulary has, else hermes",
    )
    add(
        "--enable-auto-tool-choice",
        action="store_true",
        help="vLLM's flag, accepted so that its command lines start the gateway: pdserve "
        "always parses tool calls from chats that send tools with tool_choice auto",
    )
    add(
        "--chat-template",
        default=None,
        help="Jinja chat template used in place of the model's (chat completions, /tokenize, "
        "gRPC chat): a file, or the template itself when no such file exists and the value "
        "holds {, } or a newline",
    )
    add(
        "--generation-config",
        default="auto",
        help="sampling defaults for what a request leaves unset: auto (the model dir's "
        "generation_config.json, when it has one), none, or a directory holding one",
    )
    add_tls_flags(parser)
    add("--public-tls-cert", type=Path, default=None, help="TLS certificate of the public ports")
    add("--public-tls-key", type=Path, default=None, help="its private key (PEM)")
    add(
        "--allowed-origins",
        type=_string_list,
        default=("*",),
        help="CORS: origins whose pages may call the HTTP API, a JSON list or comma-separated; "
        "* allows any",
    )
    add("--allowed-methods", type=_string_list, default=("*",), help="CORS: allowed methods")
    add("--allowed-headers", type=_string_list, default=("*",), help="CORS: allowed headers")
    add(
        "--allow-credentials",
        action="store_true",
        help="CORS: pages may send cookies and HTTP auth",
    )
    return parser  # fmt: skip


def parse_gateway_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> GatewayConfig:
    """Flags first, then ``PDSERVE_*`` variables, then defaults; exits 2 naming a bad value."""
    parser = build_parser()
    environ = os.environ if environ is None else environ
    apply_env_defaults(parser, environ)
    args = parser.parse_args(join_negative_sizes(parser, argv))
    try:
        api_keys: tuple[str | ApiKey, ...] = tuple(args.api_key or _env_api_keys(environ))
        if args.api_key_file is not None:
            api_keys += load_api_key_file(args.api_key_file)
        if (args.public_tls_cert is None) != (args.public_tls_key is None):
            raise ValueError("--public-tls-cert and --public-tls-key must be given together")
        public_tls = (
            EdgeTlsFiles(args.public_tls_cert, args.public_tls_key)
            if args.public_tls_cert is not None
            else None
        )
        max_model_len = _max_model_len(args.max_model_len, args.model, args.hf_overrides)
        max_tokens = max_model_len if args.max_tokens_limit is None else args.max_tokens_limit
        if not 1 <= max_tokens <= max_model_len:
            raise ValueError(
                f"--max-tokens-limit must be in [1, {max_model_len}] (--max-model-len), "
                f"got {max_tokens}"
            )
        if args.body_read_timeout_s < 0:
            raise ValueError(
                f"--body-read-timeout-s must be >= 0 (0: never), got {args.body_read_timeout_s}"
            )
        limits = RequestLimits(
            max_model_len=max_model_len,
            max_tokens=max_tokens,
            max_body_bytes=args.max_body_bytes,
            body_read_timeout_s=args.body_read_timeout_s or None,
        )
        router = RouterConfig(
            prefill=args.prefill,
            decode=args.decode,
            colocated=args.colocated,
            max_retries=args.max_retries,
            on_kv_failure=args.on_kv_failure,
            lease_ms=args.lease_ms,
            local_prefill_max_tokens=args.local_prefill_max_tokens,
            health_interval_s=args.health_interval_s,
        )
        names = args.served_model_name or [args.model.resolve().name]
        return GatewayConfig(
            model_dir=args.model,
            served_model_name=names[0],
            served_model_aliases=tuple(names[1:]),
            lora_modules=tuple(module.partition("=")[0] for module in args.lora_modules),
            allow_runtime_lora_updating=args.allow_runtime_lora_updating,
            responses_store_size=args.responses_store_size,
            host=args.host,
            http_port=args.http_port,
            grpc_port=args.grpc_port,
            api_keys=api_keys,
            max_concurrent_requests=args.max_concurrent_requests,
            max_queued_requests=args.max_queued_requests,
            request_timeout_s=args.request_timeout_s or None,
            limits=limits,
            router=router,
            log_level=args.log_level,
            client_send_timeout_s=args.client_send_timeout_s or None,
            tls=tls_from_args(args),
            public_tls=public_tls,
            reasoning_parser=(
                None if args.reasoning_parser is None else ReasoningParser(args.reasoning_parser)
            ),
            tool_call_parser=None if args.tool_call_parser == "auto" else args.tool_call_parser,
            sampling_defaults=load_sampling_defaults(args.generation_config, args.model),
            chat_template=(
                None if args.chat_template is None else _read_chat_template(args.chat_template)
            ),
            cors=CorsConfig(
                allowed_origins=args.allowed_origins,
                allowed_methods=args.allowed_methods,
                allowed_headers=args.allowed_headers,
                allow_credentials=args.allow_credentials,
            ),
        )
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def _read_chat_template(value: str) -> str:
    """``--chat-template``'s template, as vLLM reads the flag: the file ``value`` names, or else
    ``value`` itself when it holds Jinja markup; a missing file is otherwise an error, so that a
    mistyped path is not served as a template that prints the path. It is compiled and tried
    where the tokenizer loads (``Tokenizer.from_model_dir``)."""
    try:
        return Path(value).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"--chat-template: {value!r} is not UTF-8 text") from None
    except OSError as exc:
        # An inline template fails to open as a file too (ENOENT, or ENAMETOOLONG when long).
        if any(char in value for char in _JINJA_CHARS):
            return value
        raise ValueError(f"--chat-template: cannot read {value!r}: {exc.strerror}") from None


def _max_model_len(
    flag: int | None, model_dir: Path, overrides: Mapping[str, Any] | None = None
) -> int:
    """``--max-model-len``, at most the model's (vLLM refuses more too: positions past it
    were never trained, and the nodes refuse it); unset: the model's."""
    if flag is None:
        return model_max_len(model_dir, overrides)
    if flag < 2:
        raise ValueError(f"--max-model-len must be >= 2, got {flag}")
    limit = _model_context_len(model_dir, overrides)
    if limit is not None and flag > limit:
        raise ValueError(
            f"--max-model-len {flag} exceeds the model's max_position_embeddings ({limit})"
        )
    return flag


def model_max_len(model_dir: Path, overrides: Mapping[str, Any] | None = None) -> int:
    """The context length from ``config.json`` (``max_position_embeddings``), or from a GGUF
    file's metadata; ``overrides``: ``--hf-overrides``."""
    value = _model_context_len(model_dir, overrides)
    if value is None:
        raise ValueError(
            f"--model: {model_dir} has no usable max_position_embeddings; pass --max-model-len"
        )
    return value


def _model_context_len(model_dir: Path, overrides: Mapping[str, Any] | None = None) -> int | None:
    """``max_position_embeddings``; None when the model does not say (or says nonsense)."""
    path = model_dir / "config.json"
    try:
        gguf_path = find_gguf(model_dir)
        if gguf_path is not None:
            path = gguf_path
            config = open_gguf(gguf_path).hf_config()
        else:
            config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model: cannot read {path}: {exc}") from None
    # A multimodal Gemma 3's language model says it in text_config (or not: its default).
    value = text_model_config(with_overrides(config, overrides)).get("max_position_embeddings")
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        return None
    return value

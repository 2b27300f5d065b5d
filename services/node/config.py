"""A node's configuration: command-line flags with ``PDSERVE_*`` environment fallbacks, parsed
once into a frozen ``NodeConfig``; the engine gets only its ``EngineConfig`` part.

Every flag ``--some-name`` falls back to ``PDSERVE_SOME_NAME`` when absent from the command line,
then to its default. A bad value is reported by argparse (exit 2) naming the flag.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kv_transfer.transport_choice import KV_SCOPES
from services.cli import (
    ENV_PREFIX,
    apply_env_defaults,
    finite_float,
    join_negative_sizes,
    parse_bytes,
    parse_json_object,
)
from services.engine import (
    CacheConfig,
    EngineConfig,
    LoraConfig,
    SchedulerConfig,
    SchedulingPolicy,
    SpeculativeConfig,
    default_max_num_batched_tokens,
)
from services.engine.config import MAX_BLOCK_SIZE
from services.engine.model_runner import check_device
from services.tls import TlsFiles, add_tls_flags, tls_from_args
from services.types import Role

KV_TRANSPORTS = ("auto", "shm", "cuda_ipc", "ucx", "loopback")


DEFAULT_GRPC_PORTS = {Role.PREFILL: 50061, Role.DECODE: 50071, Role.COLOCATED: 50081}

# Config fields whose flag is not ``--`` + the field name with dashes.
_FIELD_FLAGS = {"model_dir": "--model", "policy": "--scheduling-policy"}


@dataclass(frozen=True)
class NodeConfig:
    role: Role
    node_id: str
    """Names this node in load reports, logs and metric labels."""
    host: str
    grpc_port: int
    kv_port: int
    """Port of a listener-based KV transport (0: any free); unused by ucx and loopback."""
    kv_transport: str
    metrics_port: int | None
    """Prometheus HTTP port; None serves no metrics."""
    drain_grace_s: float
    """After SIGTERM: how long in-flight requests may take to finish."""
    engine: EngineConfig
    kv_scope: str = "host"
    """Where this node's KV peers run: "host" (this machine) or "cluster" (maybe others);
    ``kv_transport="auto"`` picks shm / cuda_ipc for host, ucx for cluster."""
    test_kv_push_pause_s: float = 0.0
    """Testing only (fault injection): each KV push this node writes holds its last message
    back this long, so a test can kill or cancel a node while pages are moving. 0 in service."""
    tls: TlsFiles | None = None
    """Mutual TLS for the gRPC port and the channels this node opens (prefill to decode); None:
    plaintext. See ``services/tls.py``."""
    test_step_delay_s: float = 0.0
    test_step_slowdown: float = 1.0
    """Testing and benchmarks only: each engine step that did work takes this much longer /
    this many times as long (a slow host, simulated). 0 and 1 in service."""
    max_unstarted_reservations: int = 16
    """Decode: reservations whose prefill has not started, at most; more wait (design §3a)."""
    max_waiting_reservations: int = 1024
    """Decode: reservations waiting for room, at most; more are refused (RESOURCE_EXHAUSTED)."""

    def __post_init__(self) -> None:
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(
                f"kv_transport must be one of {KV_TRANSPORTS}, got {self.kv_transport!r}"
            )
        if self.kv_scope not in KV_SCOPES:
            raise ValueError(f"kv_scope must be one of {KV_SCOPES}, got {self.kv_scope!r}")
        for name in ("grpc_port", "kv_port", "metrics_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {port}")
        # Port 0 asks for any free port, so two zeros do not collide.
        if self.metrics_port == self.grpc_port != 0:
            raise ValueError(f"metrics_port and grpc_port must differ, both are {self.grpc_port}")
        if self.drain_grace_s < 0:
            raise ValueError(f"drain_grace_s must be >= 0, got {self.drain_grace_s}")
        if self.test_kv_push_pause_s < 0:
            raise ValueError(f"test_kv_push_pause_s must be >= 0, got {self.test_kv_push_pause_s}")
        if self.test_step_delay_s < 0 or self.test_step_slowdown < 1:
            raise ValueError(
                f"test_step_delay_s must be >= 0 and test_step_slowdown >= 1, got "
                f"{self.test_step_delay_s} and {self.test_step_slowdown}"
            )
        if self.max_unstarted_reservations < 1 or self.max_waiting_reservations < 0:
            raise ValueError(
                "max_unstarted_reservations must be >= 1 and max_waiting_reservations >= 0, got "
                f"{self.max_unstarted_reservations} and {self.max_waiting_reservations}"
            )

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.grpc_port}"


def build_parser(role: Role | None) -> argparse.ArgumentParser:
    module = "prefill_node" if role is Role.PREFILL else "decode_node"
    parser = argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=f"pdserve {role or 'node'}: flags fall back to {ENV_PREFIX}<FLAG> variables",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    served = [r for r in Role if r.module == module] if role is not None else list(Role)
    add(
        "--role",
        type=functools.partial(_parse_role, served=served),
        default=role,
        metavar="{" + ",".join(served) + "}",
        help="what this node runs",
    )
    add("--model", type=Path, default=Path("models/tiny-llama"), help="HF model dir or GGUF file")
    add(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: on CPU the faster of bfloat16 and float32 at this model's GEMM shapes, "
        "measured once per CPU and cached; bfloat16 on CUDA",
    )
    add(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "fp8_e5m2"],
        help="the dtype the KV cache holds; auto: bfloat16 on CPU whatever --dtype (decode reads "
        "half the bytes), the compute dtype on CUDA; fp8_e5m2 (CPU only) halves bf16's bytes "
        "again at two mantissa bits. Prefill and decode nodes must agree",
    )
    add(
        "--quantization",
        default=None,
        choices=["fp8"],
        help="fp8: the decoder's projections hold fp8 weights and multiply in fp8 (a 16-bit "
        "checkpoint's quantized per row at load): on a GPU of compute capability 8.9+, or on a "
        "CPU (correct, but slower than its 16-bit path). "
        "Unset: as the checkpoint says (an fp8 checkpoint runs in fp8 where the GPU can)",
    )
    add("--device", default="cpu", help="cpu or cuda[:N]")
    add("--host", default="0.0.0.0", help="address the gRPC server binds")
    add(
        "--grpc-port",
        type=int,
        default=None,
        help="default: 50061 prefill, 50071 decode, 50081 colocated",
    )
    add(
        "--kv-port",
        type=int,
        default=0,
        help="KV listener port for listener-based transports; ucx and loopback ignore it (UCX "
        "peers connect by the worker address published in each reservation)",
    )
    add(
        "--kv-transport",
        default="auto",
        choices=KV_TRANSPORTS,
        help="auto: cuda_ipc for a device KV cache, shm for a host one when --kv-scope is host; "
        "ucx when it is cluster",
    )
    add(
        "--kv-scope",
        default="host",
        choices=KV_SCOPES,
        help="where this node's KV peers run: host (this machine only) or cluster",
    )
    add("--metrics-port", type=int, default=None, help="Prometheus /metrics port (unset: none)")
    add("--node-id", default=None, help="default: hostname:grpc-port")
    add("--block-size", type=int, default=16, help=f"tokens per KV block, 1 to {MAX_BLOCK_SIZE}")
    add("--kv-cache-memory", type=parse_bytes, default=None, help="e.g. 2GiB; default 1GiB on CPU")
    add("--gpu-memory-utilization", type=finite_float, default=0.9)
    add("--max-model-len", type=int, default=None)
    add("--max-num-seqs", type=int, default=256)
    add(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per engine step; default 2048 on CPU, 8192 on a GPU",
    )
    add("--scheduling-policy", default="fcfs", choices=[p.value for p in SchedulingPolicy])
    add(
        "--no-prefix-caching",
        "--no-enable-prefix-caching",
        action="store_true",
        help="disable prefix caching (the second spelling is vLLM's)",
    )
    # vLLM's spellings of pdserve's defaults, so that its command lines start a node.
    add(
        "--enable-prefix-caching",
        action="store_false",
        dest="no_prefix_caching",
        help="prefix caching on (the default; vLLM's flag)",
    )
    add("--attention-backend", default="auto", choices=["auto", "torch", "native", "triton"])
    add(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode steps on static buffers replayed as CUDA graphs "
        "(default: on for CUDA with the triton attention backend)",
    )
    add(
        "--hf-overrides",
        type=parse_json_object,
        default=None,
        metavar="JSON",
        help="vLLM's: values that replace the model's config.json ones, e.g. "
        "'{\"is_matryoshka\": true}' (every node of a pair must be given the same)",
    )
    add(
        "--speculative-config",
        type=parse_json_object,
        default=None,
        metavar="JSON",
        help="vLLM's: speculative decoding by n-gram prompt lookup, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}\' '
        "(decode and colocated nodes; a prefill node samples one token and never speculates)",
    )
    add(
        "--enforce-eager",
        action="store_false",
        dest="cuda_graphs",
        help="vLLM's flag: every step eager, no CUDA graphs (as --no-cuda-graphs)",
    )
    add(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) loaded at start-up, each served under its NAME "
        "(SamplingParams.lora_name; the gateway's model). Give the prefill and decode nodes "
        "the same ones.",
    )
    add(
        "--enable-lora",
        action="store_true",
        help="LoRA on without adapters at start-up: the gateway's run-time updates load them "
        "(--lora-modules turns it on too)",
    )
    add(
        "--max-loras",
        type=int,
        default=None,
        help="LoRA adapters loaded at once (default: those of --lora-modules, at least 1)",
    )
    add("--max-lora-rank", type=int, default=None, help="the largest LoRA rank taken (16)")
    add("--drain-grace-s", type=finite_float, default=30.0)
    add("--seed", type=int, default=0)
    add(
        "--test-kv-push-pause-s",
        type=finite_float,
        default=0.0,
        help="testing only: each KV push pauses this long before its last message (to kill or "
        "cancel a node while pages are moving)",
    )
    add_tls_flags(parser)
    add(
        "--test-step-delay-s",
        type=finite_float,
        default=0.0,
        help="testing only: every engine step that did work sleeps this long after it",
    )
    add(
        "--test-step-slowdown",
        type=finite_float,
        default=1.0,
        help="testing and benchmarks only: every engine step that did work takes this many "
        "times as long (a slower host, simulated)",
    )
    add(
        "--max-unstarted-reservations",
        type=int,
        default=16,
        help="decode: KV reservations whose prefill has not started, at most (more wait for "
        "one to start)",
    )
    add(
        "--max-waiting-reservations",
        type=int,
        default=1024,
        help="decode: KV reservations waiting for room, at most (more are refused: the gateway "
        "answers 429)",
    )
    return parser


def parse_node_config(
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    role: Role | None = None,
) -> NodeConfig:
    """Flags first, then ``PDSERVE_*`` variables, then defaults; exits 2 naming a bad value."""
    parser = build_parser(role)
    environ = os.environ if environ is None else environ
    apply_env_defaults(parser, environ)
    args = parser.parse_args(join_negative_sizes(parser, argv))
    if args.role is None:
        parser.error("--role is required (prefill, decode or colocated)")
    grpc_port = args.grpc_port if args.grpc_port is not None else DEFAULT_GRPC_PORTS[args.role]
    lora_on = args.enable_lora or bool(args.lora_modules)
    if not lora_on and (args.max_loras is not None or args.max_lora_rank is not None):
        parser.error("--max-loras and --max-lora-rank need --enable-lora or --lora-modules")
    try:
        engine = EngineConfig(
            model_dir=args.model,
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            device=args.device,
            max_model_len=args.max_model_len,
            seed=args.seed,
            attention_backend=args.attention_backend,
            cuda_graphs=args.cuda_graphs,
            quantization=args.quantization,
            hf_overrides=args.hf_overrides,
            speculative=(
                None
                if args.speculative_config is None
                else SpeculativeConfig.from_mapping(args.speculative_config)
            ),
            cache=CacheConfig(
                block_size=args.block_size,
                kv_cache_memory=args.kv_cache_memory,
                gpu_memory_utilization=args.gpu_memory_utilization,
                enable_prefix_caching=not args.no_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=(
                    args.max_num_batched_tokens
                    if args.max_num_batched_tokens is not None
                    else default_max_num_batched_tokens(args.device, offline=False)
                ),
                policy=SchedulingPolicy(args.scheduling_policy),
            ),
            lora=None
            if not lora_on
            else LoraConfig(
                max_loras=args.max_loras
                if args.max_loras is not None
                else max(1, len(args.lora_modules or ())),
                max_lora_rank=args.max_lora_rank if args.max_lora_rank is not None else 16,
                lora_modules=tuple(args.lora_modules or ()),
            ),
        )
        config = NodeConfig(
            role=args.role,
            node_id=args.node_id or f"{socket.gethostname()}:{grpc_port}",
            host=args.host,
            grpc_port=grpc_port,
            kv_port=args.kv_port,
            kv_transport=args.kv_transport,
            kv_scope=args.kv_scope,
            metrics_port=args.metrics_port,
            drain_grace_s=args.drain_grace_s,
            engine=engine,
            test_kv_push_pause_s=args.test_kv_push_pause_s,
            tls=tls_from_args(args),
            test_step_delay_s=args.test_step_delay_s,
            test_step_slowdown=args.test_step_slowdown,
            max_unstarted_reservations=args.max_unstarted_reservations,
            max_waiting_reservations=args.max_waiting_reservations,
        )
        check_before_load(config)
    except ValueError as exc:
        parser.error(name_flags(str(exc)))
        raise  # unreachable: parser.error exits
    return config


def _parse_role(value: str, *, served: Sequence[Role]) -> Role:
    try:
        role = Role(value)
    except ValueError:
        choices = ", ".join(repr(str(r)) for r in served)
        raise argparse.ArgumentTypeError(
            f"invalid choice: {value!r} (choose from {choices})"
        ) from None
    if role not in served:
        raise argparse.ArgumentTypeError(f"--role {role} runs as python -m {role.module}")
    return role


def lora_module(text: str) -> tuple[str, Path]:
    """``--lora-modules``' ``NAME=PATH`` (vLLM's spelling)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, Path(path)


def check_before_load(config: NodeConfig) -> None:
    """Refusals that need only the flags, made before the model loads (seconds to minutes):
    ValueError naming the flag."""
    engine = config.engine
    device = torch.device(engine.device)
    try:
        check_device(device)
    except ValueError as exc:
        problem = str(exc).removeprefix(f"device {engine.device!r}: ")
        raise ValueError(f"--device {engine.device}: {problem}") from None
    on_cpu = device.type == "cpu"
    # TRITON_INTERPRET=1 runs the Triton kernels on the CPU, for tests.
    if engine.attention_backend == "triton" and on_cpu and not _triton_interpreted():
        raise ValueError(
            "--attention-backend triton needs a CUDA --device (its kernels are GPU-only), "
            f"got --device {engine.device}"
        )
    if config.kv_transport == "cuda_ipc" and on_cpu:
        raise ValueError(
            "--kv-transport cuda_ipc carries GPU memory, and this node's KV cache is on the "
            f"CPU (--device {engine.device}): use shm, or auto"
        )
    memory = engine.cache.kv_cache_memory
    if memory is not None and on_cpu:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if memory > total:
            raise ValueError(
                f"--kv-cache-memory of {memory} bytes is more than this machine's memory "
                f"({total} bytes)"
            )


def _triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _flags_by_field() -> dict[str, str]:
    fields: dict[str, str] = {}
    for action in build_parser(None)._actions:  # argparse has no public iterator
        if action.option_strings and "_" in action.dest:
            # The first flag of a field is its own; a later one (vLLM's spelling) is an alias.
            fields.setdefault(action.dest, action.option_strings[0])
    return fields | _FIELD_FLAGS


def name_flags(message: str) -> str:
    """``message`` with each config field it names (``max_num_seqs``) replaced by its flag
    (``--max-num-seqs``): the engine's messages name fields, for its offline API's callers.
    Only underscored names are replaced: a bare word like "model" is prose too."""
    flags = _flags_by_field()
    pattern = r"\b(" + "|".join(map(re.escape, sorted(flags, key=len, reverse=True))) + r")\b"
    return re.sub(pattern, lambda m: flags[m.group(1)], message)

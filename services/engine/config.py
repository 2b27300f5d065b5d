"""Engine configuration: frozen, validated dataclasses, one per component.

Values found at run time (number of KV blocks, resolved ``max_model_len``, EOS ids) are returned
by the components that find them and passed on as arguments; they are never written back here.
"""

from __future__ import annotations

import enum
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.types.engine_config_error import EngineConfigError
from services.types.sampling_params import MAX_SEED, MIN_SEED

_DTYPES = ("auto", "float32", "bfloat16", "float16")
FP8_KV_DTYPE = "fp8_e5m2"
"""The cache may also hold fp8 E5M2 (vLLM's name): half a bf16 cache's bytes, CPU only."""
_KV_DTYPES = (*_DTYPES, FP8_KV_DTYPE)
FP8_ON_CPU_ONLY = (
    "kv_cache_dtype fp8_e5m2 is supported on CPU only (the native and torch attention "
    "backends; the Triton kernels read the cache in the compute dtype)"
)


MAX_BLOCK_SIZE = 128
"""vLLM's largest block size. Unbounded, start-up times the CPU prefill kernels on a block-sized
buffer before any KV check runs: a block of 1,000,000 tokens asks for gigabytes there."""


MAX_NUM_BATCHED_TOKENS_CPU = 2048
"""A step's token budget on a CPU: a 2,048-token prefill step already runs the linears at the
GEMM peak there (``benchmarks/roofline.py``), and a larger one only delays the decodes
batched with it."""
MAX_NUM_BATCHED_TOKENS_GPU_SERVING = 8192
"""On a GPU, for a node (serving): at 2,048 a prefill step leaves the GPU mostly waiting for
the host's kernel launches. vLLM's default for its API server on H100-class GPUs."""
MAX_NUM_BATCHED_TOKENS_GPU_OFFLINE = 16384
"""On a GPU, for the offline ``LLM``, where no decode waits on a long prefill step (vLLM's
default for its ``LLM`` class on H100-class GPUs). On two H200 machines, 256 prompts of 512
tokens and 128 outputs: 12,157-16,152 output tok/s at 2,048, 21,009-25,632 at 8,192 and
22,046-26,833 at 16,384 (docs/benchmarks.md: the last two differ by less than the machines)."""


def default_max_num_batched_tokens(device: str, *, offline: bool) -> int:
    """The step token budget where none is given: per device kind, and on a GPU larger for the
    offline ``LLM`` than for a serving node."""
    # isinstance: ``LLM`` asks before ``EngineConfig`` has checked ``device`` and named it.
    if isinstance(device, str) and device.startswith("cuda"):
        return MAX_NUM_BATCHED_TOKENS_GPU_OFFLINE if offline else MAX_NUM_BATCHED_TOKENS_GPU_SERVING
    return MAX_NUM_BATCHED_TOKENS_CPU


def _check_positive_int(name: str, value: object) -> None:
    """EngineConfigError naming ``name`` unless ``value`` is an int >= 1 (a bool is not one: True
    would pass as 1)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EngineConfigError(f"{name} must be a positive integer, got {value!r}")


def _check_bool(name: str, value: object) -> None:
    """EngineConfigError naming ``name`` unless ``value`` is a bool: any other value would pass
    as truthy or falsy (``"no"`` would turn a feature on)."""
    if not isinstance(value, bool):
        raise EngineConfigError(f"{name} must be True or False, got {value!r}")


def check_hf_overrides(value: object) -> dict[str, Any]:
    """``hf_overrides`` as a JSON object's dict; EngineConfigError naming it otherwise."""
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise EngineConfigError(
            f"hf_overrides must be an object of config.json keys to values, got {value!r}"
        )
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise EngineConfigError(f"hf_overrides must be JSON values: {exc}") from None
    return dict(value)


_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


class SchedulingPolicy(enum.StrEnum):
    FCFS = "fcfs"
    PRIORITY = "priority"


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory: int | None = None
    """Bytes of KV cache to allocate. Default: 1 GiB on CPU; on GPU see gpu_memory_utilization."""
    gpu_memory_utilization: float = 0.9
    """On GPU without kv_cache_memory: the share of the device's memory the node may use; the
    KV cache gets what a profiling step (weights + activations) leaves of it."""
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _check_positive_int("block_size", self.block_size)
        if self.block_size > MAX_BLOCK_SIZE:
            raise EngineConfigError(
                f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {self.block_size}"
            )
        if self.kv_cache_memory is not None:
            memory = self.kv_cache_memory
            if isinstance(memory, bool) or not isinstance(memory, int):
                raise EngineConfigError(
                    f"kv_cache_memory must be an integer number of bytes, got {memory!r}"
                )
            if memory <= 0:
                raise EngineConfigError(f"kv_cache_memory must be > 0 bytes, got {memory}")
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, int | float):
            raise EngineConfigError(f"gpu_memory_utilization must be a number, got {utilization!r}")
        if not 0.0 < utilization <= 1.0:
            raise EngineConfigError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests in the running batch."""
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS_CPU
    """Token budget of one step, shared by decodes and prefill chunks (the ``LLM`` and the
    nodes pick ``default_max_num_batched_tokens`` for their device when not given one)."""
    policy: SchedulingPolicy = SchedulingPolicy.FCFS

    def __post_init__(self) -> None:
        policies = [str(p) for p in SchedulingPolicy]
        if self.policy not in policies:
            raise EngineConfigError(
                f"policy must be one of {', '.join(policies)}, got {self.policy!r}"
            )
        object.__setattr__(self, "policy", SchedulingPolicy(self.policy))
        _check_positive_int("max_num_seqs", self.max_num_seqs)
        _check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (vLLM's ``enable_lora``): the engine wraps the decoder's projections to add
    each request's adapter deltas (``services/models/lora.py``)."""

    max_loras: int = 1
    """Adapters loaded at once (vLLM's ``max_loras``; one step may run them all)."""
    max_lora_rank: int = 16
    """The largest rank an adapter may have (vLLM's default, 16)."""
    lora_modules: tuple[tuple[str, Path], ...] = ()
    """(name, PEFT adapter directory) pairs loaded when the engine starts (a node's
    ``--lora-modules``); the offline ``LLM`` loads its adapters as requests name them."""

    def __post_init__(self) -> None:
        _check_positive_int("max_loras", self.max_loras)
        _check_positive_int("max_lora_rank", self.max_lora_rank)
        modules = tuple((name, Path(path)) for name, path in self.lora_modules)
        names = [name for name, _ in modules]
        if any(not isinstance(name, str) or not name for name in names):
            raise EngineConfigError(f"lora_modules names must be non-empty strings, got {names}")
        if len(set(names)) != len(names):
            raise EngineConfigError(f"lora_modules names must differ, got {names}")
        if len(modules) > self.max_loras:
            raise EngineConfigError(
                f"lora_modules holds {len(modules)} adapters, max_loras is {self.max_loras}"
            )
        object.__setattr__(self, "lora_modules", modules)


SPECULATIVE_METHODS = ("ngram",)
"""Proposers built: n-gram prompt lookup (vLLM's ``ngram``). A draft model, EAGLE and MTP heads
are not built."""
_SPECULATIVE_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "disable_by_batch_size",
)
_DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config``): each decode step of an eligible
    request also computes up to ``num_speculative_tokens`` proposed tokens, and keeps those the
    model would have produced itself (``services/engine/speculative.py``)."""

    num_speculative_tokens: int
    """Proposed tokens verified per step and request, at most."""
    method: str = "ngram"
    prompt_lookup_max: int = _DEFAULT_PROMPT_LOOKUP
    """The longest suffix of a request's tokens looked up earlier in them (n-gram proposer)."""
    prompt_lookup_min: int = _DEFAULT_PROMPT_LOOKUP
    """The shortest suffix that may still match; no match of it proposes nothing."""
    disable_by_batch_size: int | None = None
    """No proposals while more requests than this are running (vLLM's key): verifying costs a
    row of compute per proposal, which a large batch, compute-bound already, pays in full
    (docs/benchmarks.md). None: whatever the batch."""

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise EngineConfigError(
                f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.method!r} (draft models, EAGLE and MTP are not built)"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            _check_positive_int(f"speculative_config.{name}", getattr(self, name))
        if self.disable_by_batch_size is not None:
            _check_positive_int(
                "speculative_config.disable_by_batch_size", self.disable_by_batch_size
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise EngineConfigError(
                "speculative_config.prompt_lookup_min must be <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} > {self.prompt_lookup_max}"
            )

    @classmethod
    def from_mapping(cls, value: object) -> SpeculativeConfig:
        """From vLLM's JSON object (``--speculative-config``): ``num_speculative_tokens`` is
        required; one of the two lookup bounds alone sets both (vLLM's rule)."""
        if not isinstance(value, Mapping):
            raise EngineConfigError(
                f"speculative_config must be an object of {', '.join(_SPECULATIVE_KEYS)}, "
                f"got {value!r}"
            )
        unknown = sorted(str(key) for key in value if key not in _SPECULATIVE_KEYS)
        if unknown:
            raise EngineConfigError(
                f"speculative_config: unknown key(s) {', '.join(unknown)}; known: "
                f"{', '.join(_SPECULATIVE_KEYS)}"
            )
        if "num_speculative_tokens" not in value:
            raise EngineConfigError("speculative_config.num_speculative_tokens is required")
        low = value.get("prompt_lookup_min")
        high = value.get("prompt_lookup_max")
        if high is None:
            high = _DEFAULT_PROMPT_LOOKUP if low is None else low
        if low is None:
            low = high
        return cls(
            num_speculative_tokens=value["num_speculative_tokens"],
            method=value.get("method", "ngram"),
            prompt_lookup_max=high,
            prompt_lookup_min=low,
            disable_by_batch_size=value.get("disable_by_batch_size"),
        )


@dataclass(frozen=True)
class EngineConfig:
    model_dir: Path
    """A Hugging Face model directory, a GGUF file, or a directory holding one GGUF file."""
    dtype: str = "bfloat16"
    """float32, bfloat16, float16 (GPU only), or auto: on CPU the faster of bfloat16 and float32
    for this model's GEMMs, measured once per CPU (``dtype_choice.py``); bfloat16 on CUDA."""
    kv_cache_dtype: str = "auto"
    """float32, bfloat16, float16 (GPU only), fp8_e5m2 (CPU only), or auto: bfloat16 on CPU
    whatever the compute dtype (decode is memory-bound, and bf16 halves its K/V reads), the
    compute dtype on CUDA (the Triton kernels read the cache in the query's dtype). See
    ``dtype_choice.py``."""
    device: str = "cpu"
    """``cpu``, ``cuda`` or ``cuda:N``. CUDA's presence is checked when the engine starts (a
    config for a GPU node may be built on a machine without one)."""
    max_model_len: int | None = None
    """Longest prompt + output; default: the model's max_position_embeddings."""
    seed: int | None = 0
    """Seed of the generator that the rows of requests without a seed of their own draw from:
    the same seed and the same calls give the same tokens run after run, whatever else uses
    torch's global RNG. None: a fresh seed from the OS, different for every engine (vLLM's
    ``seed=None``). Requests with their own ``SamplingParams.seed`` do not depend on it. Any
    seed ``torch.Generator.manual_seed`` takes: [-2**63, 2**64 - 1]."""
    attention_backend: str = "auto"
    """``torch`` (portable), ``native`` (C++ CPU kernel, built on first use), ``triton`` (GPU
    kernels), or ``auto``: triton on CUDA, native on CPU where it builds, torch otherwise."""
    cuda_graphs: bool | None = None
    """Decode-only steps on static buffers, replayed as CUDA graphs (``static_decode.py``).
    None: on for CUDA with an attention backend that reads only each context's own blocks
    (triton), off otherwise. True on CPU runs the static buffers eagerly (for tests)."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoraConfig | None = None
    """LoRA adapters on; None: off (the projections are not wrapped)."""
    quantization: str | None = None
    """``fp8``: the decoder's projections hold fp8 weights and multiply in fp8 (a 16-bit
    checkpoint's quantized per row at load; a GPU of compute capability 8.9+, or a CPU). None:
    as the checkpoint says: an fp8 checkpoint multiplies in fp8 where the GPU can, and is
    dequantized elsewhere (``fp8_linear.choose_fp8_linears``)."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding on (``SpeculativeConfig``); None: off."""
    hf_overrides: Mapping[str, Any] | None = None
    """vLLM's ``hf_overrides``: values that replace the model's ``config.json`` ones (a nested
    object merged key by key; ``models.config.with_overrides``), e.g. ``{"is_matryoshka":
    true}`` or a ``rope_scaling``. Part of the KV layout's model id: two nodes with different
    overrides refuse each other's KV."""

    def __post_init__(self) -> None:
        if not isinstance(self.model_dir, str | os.PathLike):
            raise EngineConfigError(
                "model_dir must be a path (a Hugging Face model directory, a GGUF file, or a "
                f"directory holding one), got {self.model_dir!r}"
            )
        object.__setattr__(self, "model_dir", Path(self.model_dir))
        if self.dtype not in _DTYPES:
            raise EngineConfigError(
                f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}"
            )
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise EngineConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype == "float16" and self.device == "cpu":
            raise EngineConfigError(
                "dtype float16 is supported on GPU only; use bfloat16 or float32"
            )
        if self.kv_cache_dtype not in _KV_DTYPES:
            raise EngineConfigError(
                f"kv_cache_dtype must be one of {', '.join(_KV_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.kv_cache_dtype == "float16" and self.device == "cpu":
            raise EngineConfigError(
                "kv_cache_dtype float16 is supported on GPU only; use bfloat16 or float32"
            )
        triton = self.device.startswith("cuda") or self.attention_backend == "triton"
        if triton and self.kv_cache_dtype == FP8_KV_DTYPE:
            raise EngineConfigError(FP8_ON_CPU_ONLY)
        if triton and self.dtype != "auto" and self.kv_cache_dtype not in ("auto", self.dtype):
            # dtype auto is resolved at start-up; dtype_choice.choose_kv_cache_dtype checks it.
            raise EngineConfigError(
                f"kv_cache_dtype {self.kv_cache_dtype} differs from dtype {self.dtype}: the "
                "Triton attention kernels (CUDA) read the cache in the compute dtype; use "
                "kv_cache_dtype auto"
            )
        if self.attention_backend not in ("auto", "torch", "native", "triton"):
            raise EngineConfigError(
                "attention_backend must be auto, torch, native or triton, "
                f"got {self.attention_backend!r}"
            )
        if self.max_model_len is not None:
            _check_positive_int("max_model_len", self.max_model_len)
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise EngineConfigError(f"seed must be an integer or None, got {seed!r}")
        if seed is not None and not MIN_SEED <= seed <= MAX_SEED:
            raise EngineConfigError(f"seed must be in [-2**63, 2**64 - 1], got {seed}")
        if self.cuda_graphs is not None:
            _check_bool("cuda_graphs", self.cuda_graphs)
        if self.quantization not in (None, "fp8"):
            raise EngineConfigError(f"quantization must be fp8 or None, got {self.quantization!r}")
        if self.hf_overrides is not None:
            object.__setattr__(self, "hf_overrides", check_hf_overrides(self.hf_overrides))
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise EngineConfigError(
                f"speculative must be a SpeculativeConfig or None, got {self.speculative!r}"
            )
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise EngineConfigError(f"lora must be a LoraConfig or None, got {self.lora!r}")

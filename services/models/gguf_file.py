"""One GGUF file (llama.cpp's single-file checkpoint), read without torch.

A GGUF holds what a Hugging Face directory spreads over several files: hyper-parameters,
tokenizer (vocabulary, merges, special token ids) and chat template as metadata under llama.cpp's
key names, then the tensors, often quantized. This module reads the metadata and translates it to
the ``config.json`` / ``generation_config.json`` vocabulary the rest of pdserve speaks, so that
``ModelConfig.from_hf_dict`` builds the config and the gateway builds its tokenizer from the same
file. It is plain Python (no torch, no numpy): the gateway image uses it too. It also indexes the
tensors (name, shape, type, where their bytes are); ``gguf_loader`` turns those into weights.

``--model`` names a GGUF either directly (``path/to/model.gguf``) or as a directory that holds
exactly one ``.gguf`` file and no ``config.json`` (a directory with a ``config.json`` is a
Hugging Face model directory).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.models.model_file_error import ModelFileError
from services.types import EngineConfigError

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
ROPE_FREQS = "rope_freqs.weight"
"""Llama 3.1's rotary frequency divisors, a tensor of the file that is no weight."""
GGUF_ROPE_FREQS = "pdserve_gguf_rope_freqs"
"""The ``rope_type`` of ``hf_config`` for a file with ``ROPE_FREQS``: llama.cpp's converter
writes Llama 3.1's ``rope_scaling`` as that tensor alone, no metadata
(``config.RopeFrequencyFactors``)."""

# GGUF ``general.architecture`` → the Hugging Face architecture it is. Mistral (7B, Nemo) GGUFs
# are written as ``llama``: the network is the same (no sliding window in llama.cpp's files).
SUPPORTED_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
# ``model_type`` where it is not the GGUF architecture's name.
_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3moe": "qwen3_moe"}
ROUTER_TENSOR = "ffn_gate_inp"
"""A mixture-of-experts layer's router (``blk.N.ffn_gate_inp.weight``); a layer without one
is dense (a Qwen3-MoE's ``mlp_only_layers``)."""
# Gemma 2 in llama.cpp: every other layer sliding, the first included (fixed in its code).
_GEMMA2_PATTERN = 2
# llama.cpp's Gemma 3: the sliding-window layers' RoPE base and the pattern of global layers
# are fixed in its code (a file may give the pattern), not written by its converter.
_GEMMA3_LOCAL_ROPE_THETA = 10000.0
_GEMMA3_PATTERN = 6
_GEMMA3_27B_LAYERS = 62
_GEMMA2_27B_LAYERS = 46
# Phi-3's 128k-context files: LongRoPE's two sets of frequency factors, which pdserve refuses
# in config.json too.
_LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def find_gguf(path: Path | str) -> Path | None:
    """The GGUF file ``path`` names, or None when it is a Hugging Face model directory.

    Raises ``EngineConfigError`` for a directory holding several GGUF files (which one is
    ambiguous).
    """
    path = Path(path)
    if path.suffix == GGUF_SUFFIX and not path.is_dir():
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    candidates = sorted(p for p in path.glob(f"*{GGUF_SUFFIX}") if p.is_file())
    if len(candidates) > 1:
        names = ", ".join(p.name for p in candidates)
        raise EngineConfigError(f"{path} holds several GGUF files ({names}); name one of them")
    return candidates[0] if candidates else None


def open_gguf(path: Path | str) -> GgufFile:
    """The file at ``path``, parsed once per process while it is unchanged.

    The config, the KV fingerprint and the loader all read the same header (a 49k-token
    vocabulary is a few MB of strings).
    """
    path = Path(path).resolve()
    stat = path.stat()
    return _open_cached(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_cached(path: Path, mtime_ns: int, size: int) -> GgufFile:
    return GgufFile(path)


@dataclass(frozen=True)
class GgufTensorInfo:
    name: str
    shape: tuple[int, ...]
    """As GGUF lists it: innermost (contiguous) dimension first."""
    type_id: int
    """A ``gguf.GGMLQuantizationType`` value."""
    offset: int
    """Byte offset of the tensor's data from the start of the file."""


# GGUF value types (gguf.GGUFValueType): struct format of each scalar type.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING = 8
# gguf.GGMLQuantizationType's F32, F16 and BF16: the tensor types that are not quantized.
_UNQUANTIZED_TYPES = frozenset({0, 1, 30})
_F32 = 0
_ARRAY = 9
_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32


class _Cursor:
    """Little-endian reads from a memory-mapped GGUF header."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.scalar("Q")
        raw = self.data[self.pos : self.pos + size]
        self.pos += size
        return raw.decode("utf-8", errors="replace")

    def value(self, type_id: int) -> Any:
        if type_id in _SCALARS:
            return self.scalar(_SCALARS[type_id])
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            item_type, count = self.scalar("I"), self.scalar("Q")
            if item_type in _SCALARS:
                fmt = f"<{count}{_SCALARS[item_type]}"
                items = list(struct.unpack_from(fmt, self.data, self.pos))
                self.pos += struct.calcsize(fmt)
                return items
            return [self.value(item_type) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {type_id}")


class GgufFile:
    """The metadata and tensor index of one GGUF file (the header only; no tensor is read)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                self._metadata, self._tensors = self._parse(m)
        except (ValueError, OSError, struct.error, UnicodeDecodeError) as exc:
            raise ModelFileError(self.path, f"not a readable GGUF file: {exc}") from exc

    @staticmethod
    def _parse(data: mmap.mmap) -> tuple[dict[str, Any], list[GgufTensorInfo]]:
        cursor = _Cursor(data)
        if data[:4] != _MAGIC:
            raise ValueError("bad magic (not a GGUF file)")
        cursor.pos = 4
        version = cursor.scalar("I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (pdserve reads versions 2 and 3)")
        num_tensors, num_fields = cursor.scalar("Q"), cursor.scalar("Q")
        metadata = {}
        for _ in range(num_fields):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.scalar("I"))
        raw_tensors = []
        for _ in range(num_tensors):
            name = cursor.string()
            num_dims = cursor.scalar("I")
            shape = tuple(cursor.scalar("Q") for _ in range(num_dims))
            raw_tensors.append((name, shape, cursor.scalar("I"), cursor.scalar("Q")))
        alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        data_start = -(-cursor.pos // alignment) * alignment
        tensors = [
            GgufTensorInfo(name, shape, type_id, data_start + offset)
            for name, shape, type_id, offset in raw_tensors
        ]
        return metadata, tensors

    def value(self, key: str, default: Any = None) -> Any:
        """One metadata value as plain Python (str, int, float, bool or list), or ``default``."""
        return self._metadata.get(key, default)

    @property
    def architecture(self) -> str:
        """``general.architecture``, checked against the ones pdserve implements."""
        arch = self.value("general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            supported = ", ".join(SUPPORTED_GGUF_ARCHITECTURES)
            raise EngineConfigError(
                f"unsupported GGUF architecture {arch!r} in {self.path.name}; "
                f"pdserve supports {supported}"
            )
        return arch

    @property
    def tensors(self) -> list[GgufTensorInfo]:
        return list(self._tensors)

    @property
    def tensor_names(self) -> frozenset[str]:
        return frozenset(t.name for t in self._tensors)

    @property
    def is_quantized(self) -> bool:
        """Whether any tensor is stored in a quantized type (Q4_1, Q8_0, the K-quants, ...)
        rather than F32, F16 or BF16."""
        return any(t.type_id not in _UNQUANTIZED_TYPES for t in self._tensors)

    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` this file's metadata stands for."""
        arch = self.architecture

        def param(key: str, default: Any = None) -> Any:
            return self.value(f"{arch}.{key}", default)

        theta = float(param("rope.freq_base", 10000.0))
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
        rope_scaling = param("rope.scaling.type", "none")
        if rope_scaling == "linear":
            rope = {"rope_type": "linear", "rope_theta": theta,
                    "factor": param("rope.scaling.factor")}  # fmt: skip
        elif rope_scaling != "none":
            raise EngineConfigError(
                f"unsupported rope scaling {rope_scaling!r} in GGUF file {self.path.name}; "
                "pdserve loads GGUF files with plain, linear or Llama 3.1 (rope_freqs) rotary "
                "embeddings"
            )
        if any(name in self.tensor_names for name in _LONGROPE_TENSORS):
            raise EngineConfigError(
                f"unsupported rope scaling 'longrope' in GGUF file {self.path.name} (Phi-3's "
                "long-context variants); pdserve runs the short-context ones"
            )
        if ROPE_FREQS in self.tensor_names:
            # Llama 3.1 and 3.2: llama.cpp's converter writes their rope_scaling as this tensor
            # of one divisor per frequency, and no metadata.
            rope = {"rope_type": GGUF_ROPE_FREQS, "rope_theta": theta,
                    "factors": self._f32_values(ROPE_FREQS)}  # fmt: skip
        num_heads = param("attention.head_count")
        num_kv_heads = param("attention.head_count_kv", num_heads)
        if not isinstance(num_heads, int) or not isinstance(num_kv_heads, int):
            raise EngineConfigError(
                f"GGUF file {self.path.name} gives per-layer head counts; pdserve needs one count"
            )
        hidden_size = param("embedding_length")
        head_dim = param("attention.key_length") or hidden_size // num_heads
        rotary_dim = param("rope.dimension_count", head_dim)
        if arch == "phi3" and rotary_dim != head_dim:
            # Phi-4-mini: rotary over 3/4 of each head, which config.json's
            # partial_rotary_factor says and pdserve refuses there too. (Only Phi's converter
            # writes a partial count; others' may write hidden / heads beside a wider head.)
            rope["partial_rotary_factor"] = rotary_dim / head_dim
        names = self.tensor_names
        window = param("attention.sliding_window")
        extra: dict[str, Any] = {} if window is None else {"sliding_window": window}
        if arch in ("gemma2", "gemma3"):
            extra.update(self._gemma_config(arch, param, hidden_size, num_heads, head_dim))
        architecture, model_type = SUPPORTED_GGUF_ARCHITECTURES[arch], _MODEL_TYPES.get(arch, arch)
        if param("expert_count"):
            experts = self._experts_config(arch, param)
            extra.update(experts)
            if arch == "llama":  # Mixtral: llama.cpp's llama with experts
                architecture, model_type = "MixtralForCausalLM", "mixtral"
        return {
            **extra,
            "architectures": [architecture],
            "model_type": model_type,
            "vocab_size": param("vocab_size") or len(self.value("tokenizer.ggml.tokens", [])),
            "hidden_size": hidden_size,
            "intermediate_size": extra.pop("intermediate_size", param("feed_forward_length")),
            "num_hidden_layers": param("block_count"),
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": float(param("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_parameters": rope,
            "max_position_embeddings": param("context_length", 2048),
            # llama.cpp drops output.weight when the head shares the embedding matrix.
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "bos_token_id": self.value("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.value("tokenizer.ggml.eos_token_id"),
        }

    def _experts_config(self, arch: str, param: Callable[..., Any]) -> dict[str, Any]:
        """A mixture of experts' ``config.json`` keys, as llama.cpp's converters write them and
        its graphs compute: Mixtral (``llama`` with experts) and OLMoE experts of
        ``feed_forward_length`` in every layer (OLMoE's probabilities not renormalized, unless
        ``expert_weights_norm`` says); Qwen3-MoE's of ``expert_feed_forward_length``,
        renormalized, in every layer with a router (``ROUTER_TENSOR``), the others dense."""
        if arch not in ("llama", "qwen3moe", "olmoe"):
            raise EngineConfigError(
                f"GGUF file {self.path.name}: a mixture of experts of architecture {arch!r} "
                "is not supported (llama (Mixtral), qwen3moe and olmoe are)"
            )
        count, used = param("expert_count"), param("expert_used_count")
        if arch == "llama":
            return {"num_local_experts": count, "num_experts_per_tok": used}
        keys: dict[str, Any] = {"num_experts": count, "num_experts_per_tok": used}
        if arch == "olmoe":
            keys["norm_topk_prob"] = bool(param("expert_weights_norm", False))
            expert_size = param("expert_feed_forward_length")
            if expert_size is not None:
                keys["intermediate_size"] = expert_size
            return keys
        keys["norm_topk_prob"] = bool(param("expert_weights_norm", True))
        keys["moe_intermediate_size"] = param("expert_feed_forward_length")
        routed = {
            int(name.split(".")[1])
            for name in self.tensor_names
            if name.endswith(f".{ROUTER_TENSOR}.weight")
        }
        keys["mlp_only_layers"] = [i for i in range(param("block_count")) if i not in routed]
        return keys

    def _gemma_config(
        self,
        arch: str,
        param: Callable[..., Any],
        hidden_size: int,
        num_heads: int,
        head_dim: int,
    ) -> dict[str, Any]:
        """What llama.cpp fixes in code for Gemma 2 and 3: which layers slide (every N-th layer
        global, the rest sliding: Gemma 3's N 6, Gemma 2's 2) unless
        ``attention.sliding_window_pattern`` says (its N, or one flag per layer, true for a
        sliding-window one), Gemma 3's local RoPE base, and the query scale: ``head_dim **
        -0.5``, but ``(hidden_size / num_heads) ** -0.5`` for the 27B (Gemma 3's 62 layers,
        Gemma 2's 46); Gemma 2's soft-capping is in the file."""
        num_layers = param("block_count")
        default = _GEMMA3_PATTERN if arch == "gemma3" else _GEMMA2_PATTERN
        pattern = param("attention.sliding_window_pattern", default)
        if isinstance(pattern, list):
            if len(pattern) != num_layers:
                raise ModelFileError(
                    self.path,
                    f"sliding_window_pattern holds {len(pattern)} flags for {num_layers} layers",
                )
            types = ["sliding_attention" if flag else "full_attention" for flag in pattern]
        elif isinstance(pattern, int) and pattern > 0:
            types = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(num_layers)
            ]
        else:
            raise ModelFileError(self.path, f"bad sliding_window_pattern {pattern!r}")
        largest = _GEMMA3_27B_LAYERS if arch == "gemma3" else _GEMMA2_27B_LAYERS
        scalar = hidden_size // num_heads if num_layers == largest else head_dim
        config: dict[str, Any] = {"layer_types": types, "query_pre_attn_scalar": scalar}
        if arch == "gemma3":
            config["rope_local_base_freq"] = _GEMMA3_LOCAL_ROPE_THETA
        else:
            config["attn_logit_softcapping"] = param("attn_logit_softcapping")
            config["final_logit_softcapping"] = param("final_logit_softcapping")
        return config

    def _f32_values(self, name: str) -> list[float]:
        """The values of a small F32 tensor (``rope_freqs``), read from the file."""
        (tensor,) = [t for t in self._tensors if t.name == name]
        count = math.prod(tensor.shape)
        if tensor.type_id != _F32:
            raise ModelFileError(self.path, f"tensor {name!r} is not F32 (type {tensor.type_id})")
        with open(self.path, "rb") as f:
            f.seek(tensor.offset)
            data = f.read(4 * count)
        if len(data) != 4 * count:
            raise ModelFileError(self.path, f"tensor {name!r} runs past the end of the file")
        return list(struct.unpack(f"<{count}f", data))

    def generation_config(self) -> dict[str, Any]:
        """The ids that end a turn: EOS, and end-of-turn / end-of-message where the file names them
        (Llama 3's ``<|eot_id|>``)."""
        eos_ids: list[int] = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            token_id = self.value(f"tokenizer.ggml.{key}")
            if isinstance(token_id, int) and token_id not in eos_ids:
                eos_ids.append(token_id)
        return {"eos_token_id": eos_ids} if eos_ids else {}

    def config_json(self) -> str:
        """``hf_config`` as canonical JSON (the model's fingerprint input)."""
        return json.dumps(self.hf_config(), sort_keys=True)

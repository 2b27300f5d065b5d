"""One GGUF file (llama.cpp's single-file checkpoint), read without torch.

A GGUF holds what a Hugging Face directory spreads over several files: hyper-parameters,
tokenizer (vocabulary, merges, special token ids) and chat template as metadata under llama.cpp's
key names, then the tensors, often quantized. This module reads the metadata and translates it to
the ``config.json`` / ``generation_config.json`` vocabulary the rest of pdserve speaks, so that
``ModelConfig.from_hf_dict`` builds the config and the gateway builds its tokenizer from the same
file. It imports no torch: the gateway uses it too. ``gguf_loader`` turns the tensors into weights.

``--model`` names a GGUF either directly (``path/to/model.gguf``) or as a directory that holds
exactly one ``.gguf`` file and no ``config.json`` (a directory with a ``config.json`` is a
Hugging Face model directory).
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, ReaderTensor

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"

# GGUF ``general.architecture`` → the Hugging Face architecture it is. Mistral (7B, Nemo) GGUFs
# are written as ``llama``: the network is the same (no sliding window in llama.cpp's files).
SUPPORTED_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def find_gguf(path: Path | str) -> Path | None:
    """The GGUF file ``path`` names, or None when it is a Hugging Face model directory.

    Raises ``ValueError`` for a directory holding several GGUF files (which one is ambiguous).
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
        raise ValueError(f"{path} holds several GGUF files ({names}); name one of them")
    return candidates[0] if candidates else None


def open_gguf(path: Path | str) -> GgufFile:
    """The file at ``path``, parsed once per process while it is unchanged.

    NOTE: parsing the metadata of a 49k-token vocabulary takes seconds (the ``gguf`` reader walks
    every string); the config, the KV fingerprint and the loader all read the same file.
    """
    path = Path(path).resolve()
    stat = path.stat()
    return _open_cached(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_cached(path: Path, mtime_ns: int, size: int) -> GgufFile:
    return GgufFile(path)


class GgufFile:
    """The metadata and tensor index of one GGUF file (tensor data stays memory-mapped)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        try:
            self._reader = GGUFReader(self.path)
        except (ValueError, OSError) as exc:
            raise ValueError(f"{self.path} is not a readable GGUF file: {exc}") from exc

    def value(self, key: str, default: Any = None) -> Any:
        """One metadata value as plain Python (str, int, float, bool or list), or ``default``."""
        field = self._reader.get_field(key)
        if field is None:
            return default
        value = field.contents()
        if isinstance(value, np.generic):
            return value.item()
        return value

    @property
    def architecture(self) -> str:
        """``general.architecture``, checked against the ones pdserve implements."""
        arch = self.value("general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            supported = ", ".join(SUPPORTED_GGUF_ARCHITECTURES)
            raise ValueError(
                f"unsupported GGUF architecture {arch!r} in {self.path.name}; "
                f"pdserve supports {supported}"
            )
        return arch

    @property
    def tensors(self) -> list[ReaderTensor]:
        return self._reader.tensors

    @property
    def tensor_names(self) -> frozenset[str]:
        return frozenset(t.name for t in self._reader.tensors)

    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` this file's metadata stands for."""
        arch = self.architecture

        def param(key: str, default: Any = None) -> Any:
            return self.value(f"{arch}.{key}", default)

        rope_scaling = param("rope.scaling.type", "none")
        if rope_scaling != "none" or "rope_freqs.weight" in self.tensor_names:
            kind = rope_scaling if rope_scaling != "none" else "rope_freqs (Llama 3.1 style)"
            raise ValueError(
                f"unsupported rope scaling {kind!r} in GGUF file {self.path.name}; "
                "pdserve loads GGUF files with plain rotary embeddings only"
            )
        num_heads = param("attention.head_count")
        num_kv_heads = param("attention.head_count_kv", num_heads)
        if not isinstance(num_heads, int) or not isinstance(num_kv_heads, int):
            raise ValueError(
                f"GGUF file {self.path.name} gives per-layer head counts; pdserve needs one count"
            )
        hidden_size = param("embedding_length")
        names = self.tensor_names
        return {
            "architectures": [SUPPORTED_GGUF_ARCHITECTURES[arch]],
            "model_type": arch,
            "vocab_size": param("vocab_size") or len(self.value("tokenizer.ggml.tokens", [])),
            "hidden_size": hidden_size,
            "intermediate_size": param("feed_forward_length"),
            "num_hidden_layers": param("block_count"),
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "head_dim": param("attention.key_length") or hidden_size // num_heads,
            "rms_norm_eps": float(param("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(param("rope.freq_base", 10000.0)),
            "max_position_embeddings": param("context_length", 2048),
            # llama.cpp drops output.weight when the head shares the embedding matrix.
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "bos_token_id": self.value("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.value("tokenizer.ggml.eos_token_id"),
        }

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

"""A GGUF file's tensors as Hugging Face-named weights, dequantized, for ``load_model``.

llama.cpp renames every tensor (``blk.3.attn_q.weight`` is ``model.layers.3.self_attn.q_proj.
weight``), stores 2-D shapes innermost-first, quantizes in blocks, and — for the ``llama``
architecture only — permutes the rows of Q and K so that its rotary kernel can rotate adjacent
pairs (GPT-J style) where Hugging Face rotates the two halves of each head (``rotate_half``). Each
tensor here is dequantized to fp32 by the ``gguf`` package, given the Hugging Face name and
shape, and for Llama Q/K un-permuted; ``load_model`` then casts it into the serving dtype.
Qwen2, Qwen3, Phi-3 and Gemma files are written in Hugging Face's rotary layout and need no
permutation; Phi-3's keep its fused ``qkv_proj`` and ``gate_up_proj``; Gemma 2's and 3's norm
weights hold 1 more than their checkpoint's. A mixture of experts' projections come stacked, one
tensor of every expert's (``ffn_gate_exps``...), and are handed over expert by expert under the
checkpoint's names (Mixtral's files are ``llama`` ones with experts, its Q/K permuted likewise).
On a CPU the quantized projections and experts may instead come as codes (``gguf_linear``).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from services.models.config import ModelConfig
from services.models.gguf_blocks import GgufBlocks, decode_blocks
from services.models.gguf_file import ROPE_FREQS, GgufFile, GgufTensorInfo
from services.models.model_file_error import ModelFileError

logger = logging.getLogger(__name__)

# Quantization types we load; the gguf package implements the maths of each. F32, F16, BF16, Q8_0,
# Q4_0, Q4_1, Q5_0 and Q5_1 are checked end to end by tests (tiny conversions, and SmolLM2's Q4_1
# + Q8_0 file); the K-quants share the same byte plumbing but no test file holds them (the gguf
# package cannot write them; their codes are checked block by block against its dequantization).
# Q5_0 and Q5_1 are what llama.cpp's K-quant mixes fall back to for a tensor whose rows are not
# whole 256-value super-blocks (Qwen2.5-0.5B's 896). Other types are refused by name rather than
# guessed at.
SUPPORTED_QUANT_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Phi-3 keeps its projections fused, as its Hugging Face checkpoint does: Q, K, V rows in
    # one tensor, and the gate's rows before the up projection's in ``ffn_up``.
    "attn_qkv": "self_attn.qkv_proj",
}
# Names that differ by architecture.
# Gemma's sandwich norms: ffn_norm is the one before the MLP there.
_GEMMA_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_LAYER_NAMES = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    "gemma2": _GEMMA_NORMS,
    "gemma3": _GEMMA_NORMS,
    # A mixture of experts' router: Mixtral's (a llama file with experts), Qwen3-MoE's, OLMoE's.
    "llama": {"ffn_gate_inp": "block_sparse_moe.gate"},
    "qwen3moe": {"ffn_gate_inp": "mlp.gate"},
    "olmoe": {"ffn_gate_inp": "mlp.gate"},
}
# A mixture of experts' projections, every expert's stacked in one tensor ([experts, rows,
# columns] in Hugging Face's order): each expert's checkpoint name, Mixtral's and the others'.
_EXPERT_TENSORS = {
    "ffn_gate_exps": ("w1", "gate_proj"),
    "ffn_up_exps": ("w3", "up_proj"),
    "ffn_down_exps": ("w2", "down_proj"),
}
# llama.cpp's converter adds 1 to Gemma's RMSNorm weights (its kernel multiplies by the weight,
# Gemma's by 1 + weight); the Hugging Face weight is the file's less 1.
_NORM_SHIFTED_ARCHITECTURES = frozenset({"gemma2", "gemma3"})
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Architectures whose Q/K rows llama.cpp permutes for its pairwise rotary kernel.
_PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})


def is_expert_tensor(gguf_name: str) -> bool:
    """Whether ``gguf_name`` stacks a mixture of experts' projections (one tensor, several
    checkpoint weights)."""
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    return match is not None and match.group(2) in _EXPERT_TENSORS


def expert_names(gguf_name: str, architecture: str, num_experts: int) -> list[str]:
    """The Hugging Face names of the experts' matrices a stacked tensor holds, in order."""
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    assert match is not None and match.group(2) in _EXPERT_TENSORS, gguf_name
    layer, kind = match.group(1), match.group(2)
    mixtral, others = _EXPERT_TENSORS[kind]
    block, name = ("block_sparse_moe", mixtral) if architecture == "llama" else ("mlp", others)
    return [f"model.layers.{layer}.{block}.experts.{e}.{name}.weight" for e in range(num_experts)]


def hf_tensor_name(gguf_name: str, architecture: str = "llama") -> str:
    """The Hugging Face name of a GGUF tensor of ``architecture``; ``ValueError`` naming an
    unknown one."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _LAYER_NAMES | _ARCH_LAYER_NAMES.get(architecture, {})
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in names:
        raise ValueError(f"unexpected tensor {gguf_name!r} in the GGUF file")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{names[kind]}.{suffix}"


def gguf_weights(
    gguf: GgufFile, config: ModelConfig, codes: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor | GgufBlocks]]:
    """(Hugging Face name, tensor in Hugging Face layout) for every tensor in the file: fp32,
    or, for the names in ``codes`` (``gguf_linear.install_gguf_linears`` chose them), its
    quantized blocks as codes and scales."""
    unpermute = gguf.architecture in _PERMUTED_QK_ARCHITECTURES
    shift_norms = gguf.architecture in _NORM_SHIFTED_ARCHITECTURES
    data = np.memmap(gguf.path, dtype=np.uint8, mode="r")
    for tensor in gguf.tensors:
        if tensor.name == ROPE_FREQS:
            continue  # the rotary frequencies' divisors: the config carries them
        if is_expert_tensor(tensor.name):
            yield from _experts(data, tensor, gguf.architecture, codes, gguf.path)
            continue
        try:
            name = hf_tensor_name(tensor.name, gguf.architecture)
            weight: torch.Tensor | GgufBlocks
            if name in codes:
                qtype, raw = _raw_rows(data, tensor)
                weight = decode_blocks(raw, qtype, tensor.shape[0])
            else:
                weight = dequantize(data, tensor)
        except ValueError as exc:
            # The messages name the tensor; a node's log line must name the file too.
            raise ModelFileError(gguf.path, str(exc)) from exc
        if shift_norms and name.endswith("norm.weight"):
            weight = weight - 1.0  # type: ignore[operator]  (norms are never codes)
        if unpermute and (".q_proj." in name or ".k_proj." in name):
            num_heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
            if isinstance(weight, GgufBlocks):
                weight = weight.map_rows(partial(unpermute_rotary_rows, num_heads=num_heads))
            else:
                weight = unpermute_rotary_rows(weight, num_heads)
        yield name, weight


def _experts(
    data: np.ndarray,
    tensor: GgufTensorInfo,
    architecture: str,
    codes: frozenset[str],
    path: Path,
) -> Iterator[tuple[str, torch.Tensor | GgufBlocks]]:
    """A stacked experts' tensor (``[experts, rows, columns]``) as each expert's checkpoint
    weight: dequantized, or as codes where ``codes`` names them."""
    num_experts = tensor.shape[2] if len(tensor.shape) == 3 else 0
    names = expert_names(tensor.name, architecture, num_experts)
    try:
        if names and names[0] in codes:
            qtype, raw = _raw_rows(data, tensor)  # [experts * rows, row bytes]
            blocks = decode_blocks(raw, qtype, tensor.shape[0])
            rows = tensor.shape[1]
            for expert, name in enumerate(names):
                yield name, blocks.map_rows(lambda t, e=expert: t[e * rows : (e + 1) * rows])
            return
        stacked = dequantize(data, tensor)  # [experts, rows, columns]
    except ValueError as exc:
        raise ModelFileError(path, str(exc)) from exc
    if stacked.dim() != 3:
        raise ModelFileError(path, f"tensor {tensor.name!r} is not [experts, rows, columns]")
    for expert, name in enumerate(names):
        yield name, stacked[expert]


def dequantize(data: np.ndarray, tensor: GgufTensorInfo) -> torch.Tensor:
    """One tensor as fp32, in Hugging Face's shape (GGUF lists dimensions innermost first).

    data: the whole file as uint8 (memory-mapped)
    """
    qtype, raw = _raw_rows(data, tensor)
    values = quants.dequantize(raw, qtype)
    shape = tuple(reversed(tensor.shape))
    # NOTE: F32 comes back as a view of the read-only memory map; copy so torch owns it.
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def _raw_rows(data: np.ndarray, tensor: GgufTensorInfo) -> tuple[GGMLQuantizationType, np.ndarray]:
    """A tensor's format and its bytes as ``[rows, row bytes]`` (a view of ``data``), checked:
    a format pdserve loads, whole blocks a row, inside the file."""
    try:
        qtype = GGMLQuantizationType(tensor.type_id)
    except ValueError:
        qtype = None
    if qtype not in SUPPORTED_QUANT_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_QUANT_TYPES))
        kind = qtype.name if qtype is not None else f"unknown type {tensor.type_id}"
        raise ValueError(
            f"tensor {tensor.name!r} is quantized as {kind}, which pdserve does not load; "
            f"supported: {supported}"
        )
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    row_len = tensor.shape[0]
    num_rows = math.prod(tensor.shape[1:])
    if row_len % block_size:
        raise ValueError(
            f"tensor {tensor.name!r}: row of {row_len} is not whole {qtype.name} blocks"
        )
    row_bytes = row_len // block_size * block_bytes
    end = tensor.offset + num_rows * row_bytes
    if end > data.size:
        raise ValueError(f"tensor {tensor.name!r} runs past the end of the file (truncated?)")
    return qtype, data[tensor.offset : end].reshape(num_rows, row_bytes)


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: within each head, its rows are ordered
    (pair 0 first half, pair 0 second half, pair 1 first half, ...); Hugging Face orders them
    (all first halves, then all second halves).

    weight: [num_heads * head_dim, ...] (a weight or a bias)
    """
    head_dim = weight.shape[0] // num_heads
    rest = weight.shape[1:]
    # [num_heads, head_dim / 2, 2, ...] → [num_heads, 2, head_dim / 2, ...]
    pairs = weight.reshape(num_heads, head_dim // 2, 2, *rest)
    return pairs.transpose(1, 2).reshape(weight.shape).contiguous()

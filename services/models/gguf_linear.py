"""Decoder projections that keep a GGUF file's quantized weights as int8 codes on a CPU.

Why: dequantized to fp32 (what ``--dtype auto`` computes a quantized file in on a CPU, exact), a
Q4 file's weights take 7x their size on disk, and every decode step streams all of them from
memory. Kept as one int8 code a weight with a float32 scale (and offset) per 32 inputs
(``gguf_blocks``), a projection takes about a third of that; a 4-bit format's codes two a byte
(Q4_0, Q4_1, Q4_K: 6 bits a weight with the scales and offsets), a fifth. The decode step
streams that much less. ``csrc/quantized_linear.cpp`` runs the fp32 few-row kernel's register tiles
(``csrc/fp32_linear_kernel.h``) over blocks of a 64-column panel dequantized just before they
are used, so a projection gives the fp32 kernel's sums on the dequantized weight bit for bit: a
decode step's rows (up to 64) take each 64- or 128-input block from an L1-resident scratch, more
rows take each panel dequantized whole, once. From ``GEMM_ROWS`` rows (a prefill step) the
weight's transpose is dequantized into a per-thread scratch and multiplied by torch's GEMM,
faster there than the tiles (as the dense path runs oneDNN's GEMM there, not the fp32 kernel).

Life cycle: ``install_gguf_linears`` runs on the model built on the meta device, before its
memory is allocated (so no fp32 copy of these weights is ever made), and returns the modules
and the checkpoint names whose blocks the loader hands over as codes; the loader fills each
module's rows from them (``fill``, a fused projection from several tensors) and calls ``pack``
once all are in, which lays codes, scales and offsets out in the kernel's panels. Nothing
changes them afterwards. The lm_head is a ``GgufLinear`` too, and the token embedding looks
its rows up in the codes (``GgufEmbedding``; one table where the two are tied, as in most small
models). A mixture of experts' experts are ``GgufLinear`` modules of their own in its
``SparseMoe`` (its loop over the experts hit runs them). The norms are dequantized, as is any
projection stored as F32, F16 or BF16 or whose sizes the kernel does not take (an output width
that is not a multiple of 64: a vocabulary of 32,001).

Where it runs: a CPU where the native kernels build (any variant: AVX-512, AVX2, portable); on
by default there for a GGUF file, ``PDSERVE_GGUF_CODES=0`` dequantizes every weight at load as
before (to compare, or where memory is no object). On a GPU the file is dequantized.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType
from torch import nn

from services.models.gguf_blocks import (
    CODE_TYPES,
    NIBBLE_TYPES,
    GgufBlocks,
    group_size,
    has_offsets,
    pack_nibbles,
    unpack_nibbles,
)
from services.models.gguf_file import ROPE_FREQS, GgufFile, GgufTensorInfo
from services.models.gguf_loader import expert_names, hf_tensor_name, is_expert_tensor
from services.models.llama import SparseMoe
from services.models.native_build import UnsupportedIsaError, native_kernel_error, resolve_isa

SWITCH_ENV = "PDSERVE_GGUF_CODES"
"""``0`` dequantizes every weight of a GGUF file at load."""

PANEL = 64
"""Output columns of one of the kernel's panels (``csrc/fp32_linear_isa.h``)."""


GEMM_ROWS = 1024
"""Batches of this many rows or more (prefill chunks) multiply the weight dequantized into a
scratch buffer with torch's GEMM, which ran 1.14-1.27x the kernel's tiles at 2,048 rows of
SmolLM2's projections (1.03-1.10x of the ``small`` model's; as fast at 512 rows, slower at 128-256);
the dequantization, a write of the fp32 weight, costs a few percent of such a GEMM
(docs/benchmarks.md, "GGUF weights as codes")."""

SCRATCH_FLOATS = 16 << 20
"""The scratch's size at most (64 MiB of fp32, per thread that runs such batches): a larger
weight is dequantized and multiplied a slice of panels at a time."""

_THREAD = threading.local()


def _scratch(floats: int) -> torch.Tensor:
    """This thread's fp32 scratch, at least ``floats`` long: kept between calls, so that a
    prefill step does not fault in a fresh weight-sized buffer for every projection."""
    buffer: torch.Tensor | None = getattr(_THREAD, "scratch", None)
    if buffer is None or buffer.numel() < floats:
        buffer = torch.empty(floats)
        _THREAD.scratch = buffer
    return buffer[:floats]


def gguf_codes_unavailable_reason(device: torch.device) -> str | None:
    """None where a GGUF file's projections can stay as codes on ``device``, else why not."""
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return f"{SWITCH_ENV}=0"
    if device.type != "cpu":
        return f"no kernel for them on {device.type}"
    error = native_kernel_error()
    if error is not None:
        return f"native CPU kernels are unavailable: {error}"
    try:
        resolve_isa()
    except UnsupportedIsaError as exc:  # PDSERVE_NATIVE_ISA names one this CPU cannot run
        return str(exc)
    return None


class GgufLinear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` held as codes (int8, or 4-bit two a byte) and float32
    scales (and offsets) per ``group`` inputs; input ``[rows, in_features]`` of any float
    dtype, output the same dtype (computed in fp32)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        group: int,
        offsets: bool,
        bits: int = 8,
    ) -> None:
        """``bits``: 8 (int8 codes), or 4 (codes of 0-15 two a byte, ``gguf_blocks.
        pack_nibbles``; needs ``offsets``: a Q4_0 part's are ``-8 d``)."""
        super().__init__()
        if bits not in (4, 8) or (bits == 4 and not offsets):
            raise ValueError(f"GgufLinear holds 8-bit codes, or 4-bit ones with offsets: {bits}")
        self.in_features = in_features
        self.out_features = out_features
        self.group = group
        self.bits = bits
        groups = in_features // group
        # Parameters (not buffers) so that the model's memory is counted and moved with them;
        # never trained. [out, in * bits / 8] while the loader fills them, [out / 64,
        # in * bits / 8, 64] after ``pack``.
        code_dtype, code_width = (
            (torch.int8, in_features) if bits == 8 else (torch.uint8, in_features // 2)
        )
        self.codes = nn.Parameter(torch.empty(out_features, code_width, dtype=code_dtype), False)
        self.scales = nn.Parameter(torch.empty(out_features, groups), False)
        self.offsets = nn.Parameter(torch.empty(out_features, groups), False) if offsets else None
        self.bias = nn.Parameter(torch.empty(out_features), False) if bias else None
        self.isa = ""
        """The kernel variant (``native_build.resolve_isa``), set by ``pack``."""

    def fill(self, row: int, blocks: GgufBlocks) -> None:
        """Write ``blocks``' rows from row ``row`` on (a fused projection takes several)."""
        if self.bits == 4:
            blocks = blocks.unsigned()
        blocks = blocks.regrouped(self.group, self.offsets is not None)
        count = blocks.codes.shape[0]
        codes = blocks.codes if self.bits == 8 else pack_nibbles(blocks.codes)
        self.codes.data.narrow(0, row, count).copy_(codes)
        self.scales.data.narrow(0, row, count).copy_(blocks.scales)
        if self.offsets is not None and blocks.offsets is not None:
            self.offsets.data.narrow(0, row, count).copy_(blocks.offsets)

    def pack(self) -> None:
        """Lays the filled rows out in the kernel's ``[out / 64, ..., 64]`` panels."""
        self.isa = resolve_isa()
        for param in (self.codes, self.scales, self.offsets):
            if param is not None:
                # [out, cols] → [out / 64, 64, cols] → [out / 64, cols, 64]
                plain = param.data.view(self.out_features // PANEL, PANEL, -1)
                param.data = plain.transpose(1, 2).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in_features] → [rows, out_features], x's dtype."""
        rows = x.float().contiguous()
        if rows.shape[0] >= GEMM_ROWS:
            out = self._through_gemm(rows)
        else:
            out = torch.ops.pdserve.quantized_linear(
                rows,
                self.codes,
                self.scales,
                self.offsets,
                self.group,
                self.bits,
                self.bias,
                self.isa,
            )
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def _through_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in_features] fp32 → [rows, out_features]: the weight dequantized, a few
        panels at a time, into this thread's scratch as its transpose, and multiplied by torch's
        GEMM."""
        panels = self.out_features // PANEL
        per_chunk = max(1, SCRATCH_FLOATS // (self.in_features * PANEL))
        out = x.new_empty(x.shape[0], self.out_features) if per_chunk < panels else None
        for first in range(0, panels, per_chunk):
            last = min(panels, first + per_chunk)
            columns = slice(first * PANEL, last * PANEL)
            weight_t = _scratch(self.in_features * (last - first) * PANEL)
            weight_t = weight_t.view(self.in_features, (last - first) * PANEL)
            torch.ops.pdserve.quantized_weight_t(
                self.codes,
                self.scales,
                self.offsets,
                self.group,
                self.bits,
                first,
                last,
                weight_t,
                self.isa,
            )
            if self.bias is None:
                part = torch.mm(x, weight_t)
            else:
                part = torch.addmm(self.bias[columns], x, weight_t)
            if out is None:
                return part
            out[:, columns] = part
        assert out is not None
        return out

    def dequantized(self) -> torch.Tensor:
        """float32 ``[out, in]``: the weight the codes stand for (after ``pack``)."""
        panels = self.out_features // PANEL
        scales = self.scales.data.repeat_interleave(self.group, dim=1)  # [panels, in, 64]
        codes = self.codes.data
        if self.bits == 4:  # [panels, in / 2, 64] → [panels, in / 2, 2, 64] → [panels, in, 64]
            codes = torch.stack((codes & 0x0F, codes >> 4), dim=2).flatten(1, 2)
        weight = codes.float() * scales
        if self.offsets is not None:
            weight = weight + self.offsets.data.repeat_interleave(self.group, dim=1)
        return weight.transpose(1, 2).reshape(panels * PANEL, self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in (self.codes, self.scales, self.offsets) if p is not None)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.bits}-bit codes, "
            f"group={self.group}, offsets={self.offsets is not None}"
        )


_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
"""Our fused projections of a decoder layer → the checkpoint's modules each holds (a Phi-3 file
holds ``qkv_proj`` and ``gate_up_proj`` whole)."""


class GgufEmbedding(nn.Module):
    """A token embedding whose table is a ``GgufLinear``'s codes (``[vocab, hidden]``, the
    lm_head's own where the two are tied): each token's row dequantized when it is looked up."""

    def __init__(self, table: GgufLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype
        """The model's compute dtype, which the rows come in."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [num_tokens] → [num_tokens, hidden], each row the floats the dequantized table
        holds (multiplied and added apart, as ``GgufBlocks.dequantize`` does)."""
        table = self.table
        # Row 64 p + c of the table is column c of panel p: [panels, in, 64] → [tokens, in].
        panel, column = ids // PANEL, ids % PANEL
        codes = table.codes[panel, :, column]  # [tokens, in * bits / 8]
        rows = (codes if table.bits == 8 else unpack_nibbles(codes)).float()
        rows = rows * table.scales[panel, :, column].repeat_interleave(table.group, dim=1)
        if table.offsets is not None:
            rows = rows + table.offsets[panel, :, column].repeat_interleave(table.group, dim=1)
        return rows.to(self.dtype)

    def extra_repr(self) -> str:
        return f"num_embeddings={self.table.out_features}, embedding_dim={self.table.in_features}"


@dataclass(frozen=True)
class GgufCodes:
    """What ``install_gguf_linears`` did: the modules that hold codes, by the name of the
    parameter they replace (``model.layers.0.self_attn.qkv_proj.weight``, ``lm_head.weight``;
    ``model.embed_tokens.weight`` for an embedding's table, which may be the lm_head's module),
    and the checkpoint tensors the loader is to hand over as codes."""

    modules: dict[str, GgufLinear]
    weight_names: frozenset[str]
    """Hugging Face names (``model.layers.0.self_attn.q_proj.weight``) of those tensors."""


def _codes_module(
    types: dict[str, GGMLQuantizationType], parts: list[str], linear: nn.Linear
) -> GgufLinear | None:
    """A ``GgufLinear`` on the meta device in place of ``linear``, holding the checkpoint's
    ``parts`` one after another, grouped as finely as its finest part (Q6_K's 16 inputs), with
    offsets when any part has them, and two codes a byte when every part is 4-bit; None where a
    part is not of a format kept as codes or the kernel does not take the sizes."""
    if not all(types.get(part) in CODE_TYPES for part in parts):
        return None
    group = min(group_size(types[part]) for part in parts)
    if linear.out_features % PANEL or linear.in_features % group:
        return None
    nibbles = all(types[part] in NIBBLE_TYPES for part in parts)
    with torch.device("meta"):
        module = GgufLinear(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            group=group,
            offsets=nibbles or any(has_offsets(types[part]) for part in parts),
            bits=4 if nibbles else 8,
        )
    if module.bias is not None:
        module.bias.data = module.bias.data.float()
    return module


def _install_expert_codes(
    moe: SparseMoe,
    layer: int,
    gguf: GgufFile,
    modules: dict[str, GgufLinear],
    names: set[str],
) -> None:
    """A mixture of experts' experts as ``GgufLinear`` modules of their own where the file's
    stacked ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps`` are all of code formats: the
    stacked parameters give way to ``moe.gate_up_modules`` and ``moe.down_modules``, which the
    expert loop runs."""
    stacked = {
        kind: gguf_tensor(gguf, f"blk.{layer}.{kind}.weight")
        for kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    }
    if any(info is None for info in stacked.values()):
        return
    types = {kind: GGMLQuantizationType(info.type_id) for kind, info in stacked.items()}  # type: ignore[union-attr]
    if not all(t in CODE_TYPES for t in types.values()):
        return
    experts, hidden = moe.num_experts, moe.experts_gate_up.shape[2]
    size = moe.experts_down.shape[2]
    gate_up_kinds = (types["ffn_gate_exps"], types["ffn_up_exps"])
    shapes = {
        "gate_up": (hidden, 2 * size, gate_up_kinds),
        "down": (size, hidden, (types["ffn_down_exps"],)),
    }
    built: dict[str, list[GgufLinear]] = {}
    for part, (in_features, out_features, kinds) in shapes.items():
        group = min(group_size(t) for t in kinds)
        if out_features % PANEL or in_features % group:
            return
        nibbles = all(t in NIBBLE_TYPES for t in kinds)
        with torch.device("meta"):
            built[part] = [
                GgufLinear(
                    in_features,
                    out_features,
                    bias=False,
                    group=group,
                    offsets=nibbles or any(has_offsets(t) for t in kinds),
                    bits=4 if nibbles else 8,
                )
                for _ in range(experts)
            ]
    del moe.experts_gate_up, moe.experts_down
    moe.gate_up_modules = nn.ModuleList(built["gate_up"])
    moe.down_modules = nn.ModuleList(built["down"])
    prefix = f"model.layers.{layer}.mlp"
    for expert in range(experts):
        modules[f"{prefix}.experts_gate_up.{expert}"] = built["gate_up"][expert]
        modules[f"{prefix}.experts_down.{expert}"] = built["down"][expert]
    for kind in stacked:
        names.update(expert_names(f"blk.{layer}.{kind}.weight", gguf.architecture, experts))


def gguf_tensor(gguf: GgufFile, name: str) -> GgufTensorInfo | None:
    """The file's tensor ``name``, or None."""
    return next((t for t in gguf.tensors if t.name == name), None)


def install_gguf_linears(model: nn.Module, gguf: GgufFile) -> GgufCodes:
    """Replaces each decoder projection of ``model`` (a ``LlamaForCausalLM`` on the meta device)
    whose every tensor in ``gguf`` is of a format of ``gguf_blocks.CODE_TYPES`` with a
    ``GgufLinear``, and likewise the lm_head, the token embedding (a ``GgufEmbedding``; one
    table for both where they are tied) and a mixture of experts' experts
    (``_install_expert_codes``)."""
    types = {  # the experts' stacked tensors are looked at by _install_expert_codes
        hf_tensor_name(t.name, gguf.architecture): GGMLQuantizationType(t.type_id)
        for t in gguf.tensors
        if t.name.endswith(".weight") and t.name != ROPE_FREQS and not is_expert_tensor(t.name)
    }
    modules: dict[str, GgufLinear] = {}
    names: set[str] = set()
    for index, layer in enumerate(model.model.layers):  # type: ignore[union-attr]
        for ours, theirs in _PROJECTIONS.items():
            parent_name, attr = ours.split(".")
            parent = getattr(layer, parent_name)
            linear = getattr(parent, attr, None)
            if type(linear) is not nn.Linear:  # a mixture of experts' MLP (SparseMoe) has none
                continue
            prefix = f"model.layers.{index}"
            fused = f"{prefix}.{ours}.weight"
            parts = [fused] if fused in types else [f"{prefix}.{m}.weight" for m in theirs]
            module = _codes_module(types, parts, linear)
            if module is not None:
                setattr(parent, attr, module)
                modules[fused] = module
                names.update(parts)
        moe = getattr(layer, "mlp", None)
        if isinstance(moe, SparseMoe):
            _install_expert_codes(moe, index, gguf, modules, names)
    # The embedding's table and the lm_head: the same [vocab, hidden] matrix where tied.
    embedding: nn.Embedding = model.model.embed_tokens  # type: ignore[union-attr,assignment]
    tied = model.lm_head.weight is embedding.weight  # type: ignore[union-attr]
    head = _codes_module(types, ["model.embed_tokens.weight"], model.lm_head)  # type: ignore[arg-type]
    if head is not None:
        model.model.embed_tokens = GgufEmbedding(head, embedding.weight.dtype)  # type: ignore[union-attr]
        modules["model.embed_tokens.weight"] = head
        names.add("model.embed_tokens.weight")
        if tied:
            model.lm_head = head
    if not tied:
        head = _codes_module(types, ["lm_head.weight"], model.lm_head)  # type: ignore[arg-type]
        if head is not None:
            model.lm_head = head
            modules["lm_head.weight"] = head
            names.add("lm_head.weight")
    return GgufCodes(modules, frozenset(names))

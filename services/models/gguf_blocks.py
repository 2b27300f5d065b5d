"""A GGUF tensor's quantized blocks as int8 codes with a scale (and an offset) per group of
inputs: what ``gguf_linear.GgufLinear`` multiplies by, in place of the dequantized weight.

Why this form: every format pdserve keeps quantized dequantizes a weight as ``code * scale
(+ offset)`` with one scale (and offset) per group of 32 inputs (16 for Q6_K), in fp32, as two
roundings: Q8_0 ``d * q``; Q4_0 ``d * (q - 8)``; Q5_0 ``d * (q - 16)``; Q4_1 and Q5_1 ``d * q +
m``; Q4_K and Q5_K ``(d * sc) * q - (dmin * m)``, their 6-bit sub-block scales and mins folded
into one fp32 scale and offset per 32; Q6_K ``(d * sc) * (q - 32)`` per 16. So int8 codes plus
those fp32 numbers give back the gguf package's dequantized floats bit for bit
(``GgufBlocks.dequantize``), at 8 bits a weight plus 1-2 bits of scales (32-bit floats would
be 32); the 4-bit formats' codes two a byte (``pack_nibbles``, 4 bits a weight plus 2 of scales
and offsets), the 5- and 6-bit ones a byte each.

The decoders below follow the gguf package's ``quants`` module (and llama.cpp's block layouts)
line for line, stopping before the final multiply; the tests check each against
``quants.dequantize`` on random blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256
"""Values in a K-quant super-block."""


@dataclass(frozen=True)
class GgufBlocks:
    """A ``[rows, cols]`` weight as ``codes * scales (+ offsets)``, each scale and offset serving
    ``group`` consecutive inputs of its row."""

    codes: torch.Tensor
    """int8 ``[rows, cols]``."""
    scales: torch.Tensor
    """float32 ``[rows, cols // group]``."""
    offsets: torch.Tensor | None
    """float32 ``[rows, cols // group]``, or None (a symmetric format)."""
    group: int

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """float32 ``[rows, cols]``: the weight, the multiply and the add rounded apart."""
        rows, cols = self.codes.shape
        # [rows, groups, group] * [rows, groups, 1]
        values = self.codes.view(rows, -1, self.group).float() * self.scales.unsqueeze(-1)
        if self.offsets is not None:
            values = values + self.offsets.unsqueeze(-1)
        return values.view(rows, cols)

    def regrouped(self, group: int, with_offsets: bool) -> GgufBlocks:
        """The same weight with a scale per ``group`` inputs (a divisor of ``self.group``) and,
        when ``with_offsets``, offsets (zero for a symmetric format): the form a fused projection
        of several formats holds all its parts in."""
        if self.group % group:
            raise ValueError(f"cannot regroup groups of {self.group} into groups of {group}")
        repeat = self.group // group
        offsets = self.offsets
        if offsets is None and with_offsets:
            offsets = torch.zeros_like(self.scales)
        return GgufBlocks(
            self.codes,
            self.scales.repeat_interleave(repeat, dim=1),
            None if offsets is None else offsets.repeat_interleave(repeat, dim=1),
            group,
        )

    def unsigned(self) -> GgufBlocks:
        """The same weight with codes of 0-15 where they are 4-bit (the form two of them share a
        byte in): Q4_0's ``d * (q - 8)`` as ``d * q + (-8 d)``, exact in fp32 (``d * q``, ``8 d``
        and their sum all are: an fp16 scale times a 4-bit code). Q4_1 and Q4_K are so
        already."""
        if self.offsets is not None:
            return self
        return GgufBlocks(self.codes + 8, self.scales, self.scales * -8.0, self.group)

    def map_rows(self, rows: Callable[[torch.Tensor], torch.Tensor]) -> GgufBlocks:
        """``rows`` (a reordering or a slice of rows) applied to codes, scales and offsets
        alike."""
        return GgufBlocks(
            rows(self.codes),
            rows(self.scales),
            None if self.offsets is None else rows(self.offsets),
            self.group,
        )


def _f16(raw: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 → [n, 1] float32 (an fp16 field of each block)."""
    return raw.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """[n, parts * width] uint8 → [n, parts, 2, width]: each byte's low nibble, then its high."""
    n = qs.shape[0]
    shifted = qs.reshape(n, -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return shifted & np.uint8(0x0F)


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    d, qs = np.split(blocks, [2], axis=1)
    return qs.view(np.int8), _f16(d), None


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    d, qs = np.hsplit(blocks, [2])
    codes = _nibbles(qs, 16).reshape(blocks.shape[0], -1).astype(np.int8) - np.int8(8)
    return codes, _f16(d), None


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    d, m, qs = np.hsplit(blocks, [2, 4])
    codes = _nibbles(qs, 16).reshape(blocks.shape[0], -1).astype(np.int8)
    return codes, _f16(d), _f16(m)


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0's and Q5_1's 4 high-bit bytes and 16 nibble bytes → [n, 32] codes of 0-31 (value
    i's high bit is bit i of the little-endian word)."""
    n = qs.shape[0]
    bits = np.arange(32, dtype=np.uint32).reshape(1, 32)
    high = ((qh.view(np.uint32).reshape(n, 1) >> bits) & np.uint32(1)).astype(np.uint8)
    return _nibbles(qs, 16).reshape(n, -1) | (high << np.uint8(4))


def _q5_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    d, qh, qs = np.hsplit(blocks, [2, 6])
    return _five_bits(qh, qs).astype(np.int8) - np.int8(16), _f16(d), None


def _q5_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    d, m, qh, qs = np.hsplit(blocks, [2, 4, 8])
    return _five_bits(qh, qs).astype(np.int8), _f16(d), _f16(m)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 12 bytes → the 8 sub-blocks' 6-bit scales and mins, [n, 8] each."""
    n = scales.shape[0]
    d, m, m_d = np.split(scales.reshape(n, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(n, 8), mn.reshape(n, 8)


def _k_scales(head: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's d, dmin and 12 scale bytes → ([n, 8] scales, [n, 8] offsets)."""
    d, dmin, scales = np.hsplit(head, [2, 4])
    sc, mn = _k_scale_min(scales)
    return _f16(d) * sc.astype(np.float32), -(_f16(dmin) * mn.astype(np.float32))


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    head, qs = np.hsplit(blocks, [16])
    scale, offset = _k_scales(head)
    codes = _nibbles(qs, 32).reshape(blocks.shape[0], QK_K).astype(np.int8)
    return codes, scale, offset


def _q5_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    n = blocks.shape[0]
    head, qh, qs = np.hsplit(blocks, [16, 16 + QK_K // 8])
    scale, offset = _k_scales(head)
    low = _nibbles(qs, 32).reshape(n, -1, 32)
    bits = np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    high = ((qh.reshape(n, -1, 1, 32) >> bits) & np.uint8(0x01)).reshape(n, -1, 32)
    codes = (low | (high << np.uint8(4))).reshape(n, QK_K).astype(np.int8)
    return codes, scale, offset


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    n = blocks.shape[0]
    # ql [n, 128] (low 4 bits), qh [n, 64] (high 2 bits), scales [n, 16] int8, d [n, 2] fp16
    ql, qh, scales, d = np.hsplit(blocks, np.cumsum([QK_K // 2, QK_K // 4, QK_K // 16]))
    scale = _f16(d) * scales.view(np.int8).astype(np.float32)  # [n, 16]
    low = _nibbles(ql, 64).reshape(n, -1, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = ((qh.reshape(n, -1, 1, 32) >> shifts) & np.uint8(0x03)).reshape(n, -1, 32)
    codes = ((low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(n, QK_K)
    return codes, scale, None


_DECODERS: dict[GGMLQuantizationType, tuple[int, Callable[..., tuple]]] = {
    GGMLQuantizationType.Q8_0: (32, _q8_0),
    GGMLQuantizationType.Q4_0: (32, _q4_0),
    GGMLQuantizationType.Q4_1: (32, _q4_1),
    GGMLQuantizationType.Q5_0: (32, _q5_0),
    GGMLQuantizationType.Q5_1: (32, _q5_1),
    GGMLQuantizationType.Q4_K: (32, _q4_k),
    GGMLQuantizationType.Q5_K: (32, _q5_k),
    GGMLQuantizationType.Q6_K: (16, _q6_k),
}
"""Format → (inputs per scale, decoder of ``[blocks, block bytes]`` into codes ``[blocks,
values]``, scales and offsets ``[blocks, values / group]``)."""

CODE_TYPES = frozenset(_DECODERS)
"""The formats whose weights stay as codes; others (F32, F16, BF16) are dequantized."""


NIBBLE_TYPES = frozenset(
    {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K}
)
"""The formats of 4-bit codes: a weight whose parts are all of these keeps two codes a byte."""


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[rows, cols]`` codes of 0-15 → uint8 ``[rows, cols / 2]``: input 2j in byte j's low
    nibble, input 2j + 1 in its high one."""
    pairs = codes.to(torch.uint8).view(codes.shape[0], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``pack_nibbles`` undone along the last dimension: uint8 ``[..., n]`` → ``[..., 2 n]``."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def group_size(qtype: GGMLQuantizationType) -> int:
    """Inputs per scale of a format of ``CODE_TYPES``."""
    return _DECODERS[qtype][0]


def has_offsets(qtype: GGMLQuantizationType) -> bool:
    """Whether a format of ``CODE_TYPES`` adds an offset per group (the asymmetric ones)."""
    return qtype in (
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
    )


def decode_blocks(raw: np.ndarray, qtype: GGMLQuantizationType, row_len: int) -> GgufBlocks:
    """raw: ``[rows, row bytes]`` uint8 of one tensor, ``row_len`` values a row (whole blocks)."""
    group, decode = _DECODERS[qtype]
    block_size, block_bytes = GGML_QUANT_SIZES[qtype]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(-1, block_bytes)
    codes, scales, offsets = decode(blocks)
    groups = row_len // group

    def per_group(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(
            np.ascontiguousarray(values, dtype=np.float32).reshape(rows, groups)
        )

    return GgufBlocks(
        torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, row_len)),
        per_group(scales),
        None if offsets is None else per_group(offsets),
        group,
    )

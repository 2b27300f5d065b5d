"""Ahead-of-time compile of every Triton kernel variant (attention, the fused layer ops, the
fp8 projections' input quantization), without a GPU.

Why: the interpreter (how the CPU suite runs the kernels) accepts tile shapes that the real
compiler rejects or that spill registers to local memory, which would only show on a GPU.
``triton.compile`` builds PTX and a cubin for a target architecture with no device present;
``ptxas -v`` (shipped in Triton's wheel) then reports registers and spill bytes per kernel.

    python -m services.models.triton_compile [--arch 90]    # prints one JSON line per variant

Must run without ``TRITON_INTERPRET`` (under the interpreter ``triton.jit`` returns functions
the compiler cannot take), which is why the test runs it in a subprocess.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from services.models import triton_attention as kernels
from services.models import triton_fp8_quant as fp8_quant
from services.models import triton_layer_ops as layer_ops

logger = logging.getLogger(__name__)

DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
# The widest rows the layer ops' one-program-per-token kernels take whole (Llama-3-70B's
# hidden size): the largest register footprint.
LAYER_OPS_HIDDEN = 8192
FP8_QUANT_COLS = 28672
"""The widest input an fp8 projection quantizes (Llama-3-70B's down projection): the most
columns a program of the quantization kernel holds, and its register footprint."""
# Llama/Qwen head sizes, and GQA groups from MHA (1) to Llama-3-70B's 8.
# The GQA group changes masks and indices only (decode pads it to 16 MMA rows): one suffices.
HEAD_DIMS = (64, 128)
GROUP = 4
BLOCK_SIZE = 16


@dataclass(frozen=True)
class CompiledVariant:
    kernel: str
    dtype: str
    head_dim: int
    group: int
    block_size: int
    num_registers: int
    spill_bytes: int
    """Spill stores + spill loads reported by ptxas; must be 0."""
    shared_bytes: int
    float_fmas: int
    """Floating-point ``fma`` instructions in the PTX: rotary must have none (a fused product
    is not rounded as torch rounds it)."""


def _write_kv_signature(dtype: str) -> dict[str, str]:
    tensor = f"*{dtype}"
    return {
        **dict.fromkeys(["k_cache_ptr", "v_cache_ptr", "k_ptr", "v_ptr"], tensor),
        "slot_mapping_ptr": "*i64",
        **dict.fromkeys(
            [
                "stride_k_tok",
                "stride_k_head",
                "stride_v_tok",
                "stride_v_head",
                "stride_cache_slot",
                "stride_cache_head",
            ],
            "i32",
        ),
    }


def _decode_signature(dtype: str) -> dict[str, str]:
    f32, tensor = "*fp32", f"*{dtype}"
    return {
        "part_acc_ptr": f32,
        "part_max_ptr": f32,
        "part_sum_ptr": f32,
        "q_ptr": tensor,
        "k_cache_ptr": tensor,
        "v_cache_ptr": tensor,
        "block_tables_ptr": "*i64",
        "seq_lens_ptr": "*i64",
        "scale_log2": "fp32",
        **dict.fromkeys(
            ["stride_q_tok", "stride_q_head", "stride_kv_slot", "stride_kv_head", "stride_bt"],
            "i32",
        ),
        "num_heads": "i32",
        "num_splits": "i32",
        "partition_size": "i32",
    }


def _reduce_signature(dtype: str) -> dict[str, str]:
    return {
        "out_ptr": f"*{dtype}",
        "part_acc_ptr": "*fp32",
        "part_max_ptr": "*fp32",
        "part_sum_ptr": "*fp32",
        "stride_out_tok": "i32",
        "stride_out_head": "i32",
        "num_heads": "i32",
        "num_splits": "i32",
    }


def _prefill_signature(dtype: str) -> dict[str, str]:
    tensor = f"*{dtype}"
    return {
        "out_ptr": tensor,
        "q_ptr": tensor,
        "k_cache_ptr": tensor,
        "v_cache_ptr": tensor,
        "block_tables_ptr": "*i64",
        "chunk_token_starts_ptr": "*i64",
        "chunk_num_tokens_ptr": "*i64",
        "chunk_start_positions_ptr": "*i64",
        "scale_log2": "fp32",
        **dict.fromkeys(
            [
                "stride_q_tok",
                "stride_q_head",
                "stride_out_tok",
                "stride_out_head",
                "stride_kv_slot",
                "stride_kv_head",
                "stride_bt",
            ],
            "i32",
        ),
    }


def _layer_ops_signatures(dtype: str) -> dict[str, dict[str, str]]:
    tensor = f"*{dtype}"
    return {
        "add_rms_norm": {
            **dict.fromkeys(["out_ptr", "hidden_ptr", "pending_ptr", "weight_ptr"], tensor),
            "hidden_size": "i32",
            "eps": "fp32",
        },
        "rotary": {
            **dict.fromkeys(["q_ptr", "k_ptr", "cos_ptr", "sin_ptr"], tensor),
            **dict.fromkeys(
                ["stride_q_tok", "stride_q_head", "stride_k_tok", "stride_k_head", "num_heads"],
                "i32",
            ),
        },
        "silu_and_mul": {"out_ptr": tensor, "gate_up_ptr": tensor, "intermediate": "i32"},
        "fp8_quantize": {
            "q_ptr": "*fp8e4nv",
            "scale_ptr": "*fp32",
            "x_ptr": tensor,
            "cols": "i32",
            "static_scale": "fp32",
            "fp8_max": "fp32",
        },
        "fp8_scale_output": {
            "out_ptr": tensor,
            "raw_ptr": "*bf16",
            "x_scale_ptr": "*fp32",
            "w_scale_ptr": "*fp32",
            "bias_ptr": tensor,
            "cols": "i32",
        },
    }


def _ptxas_report(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spill bytes) of the one kernel in ``ptx``, from ``ptxas -v``."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        result = subprocess.run(
            [str(ptxas), "-v", f"--gpu-name=sm_{arch}a", str(src), "-o", str(Path(tmp) / "k.o")],
            capture_output=True,
            text=True,
            check=True,
        )
    log = result.stderr + result.stdout
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if registers is None or spills is None:
        raise RuntimeError(f"cannot read registers and spills from ptxas output:\n{log}")
    return int(registers.group(1)), int(spills.group(1)) + int(spills.group(2))


def _compile(
    fn, signature: dict[str, str], constexprs: dict, arch: int, num_warps: int, **options: object
):
    # num_stages: the launch default, as the engine launches.
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, **options}
    )


def compile_all(
    arch: int = 90, dtypes: tuple[str, ...] = tuple(DTYPES), head_dims: tuple[int, ...] = HEAD_DIMS
) -> list[CompiledVariant]:
    """Every kernel the engine can launch, for each dtype and head size."""
    if kernels.INTERPRET:
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
    results = []
    group, block_size = GROUP, BLOCK_SIZE
    for dtype, head_dim in itertools.product(dtypes, head_dims):
        short = DTYPES[dtype]
        tiles = kernels.tile_config(head_dim, getattr(torch, dtype))
        precision = "ieee" if dtype == "float32" else "tf32"
        block_d = max(16, triton.next_power_of_2(head_dim))
        common = {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "BLOCK_SIZE": block_size}
        builds = {
            "decode_partial": (
                kernels._decode_partial_kernel,
                _decode_signature(short),
                {
                    **common,
                    "GROUP": group,
                    "GROUP_PAD": max(16, triton.next_power_of_2(group)),
                    "BLOCK_N": tiles.decode_block_n,
                    "UPCAST": False,
                    "PRECISION": precision,
                },
            ),
            "prefill": (
                kernels._prefill_kernel,
                _prefill_signature(short),
                {
                    **common,
                    "GROUP": group,
                    "BLOCK_M": tiles.prefill_block_m,
                    "BLOCK_N": tiles.prefill_block_n,
                    "UPCAST": False,
                    "PRECISION": precision,
                },
            ),
        }
        builds["write_kv"] = (
            kernels._write_kv_kernel,
            _write_kv_signature(short),
            {"HEAD_DIM": head_dim, "BLOCK_D": triton.next_power_of_2(head_dim)},
        )
        builds["decode_reduce"] = (
            kernels._decode_reduce_kernel,
            _reduce_signature(short),
            {"HEAD_DIM": head_dim, "BLOCK_D": block_d},
        )
        signatures = _layer_ops_signatures(short)
        builds["rotary"] = (
            layer_ops._rotary_kernel,
            signatures["rotary"],
            {"HEAD_DIM": head_dim, "HALF_BLOCK": triton.next_power_of_2(head_dim // 2)},
        )
        if head_dim == head_dims[0]:  # the norm and SiLU kernels do not depend on head_dim
            builds["add_rms_norm"] = (
                layer_ops._add_rms_norm_kernel,
                signatures["add_rms_norm"],
                {"HAS_PENDING": True, "BLOCK": LAYER_OPS_HIDDEN},
            )
            builds["silu_and_mul"] = (
                layer_ops._silu_and_mul_kernel,
                signatures["silu_and_mul"],
                {"BLOCK": layer_ops._SILU_BLOCK},
            )
            builds["fp8_quantize"] = (
                fp8_quant._quantize_rows_kernel,
                signatures["fp8_quantize"],
                {"STATIC": False, "BLOCK": fp8_quant.quantize_block(FP8_QUANT_COLS)},
            )
            builds["fp8_scale_output"] = (
                fp8_quant._scale_output_kernel,
                signatures["fp8_scale_output"],
                {"HAS_BIAS": True, "BLOCK": fp8_quant.SCALE_BLOCK},
            )
        for name, (fn, signature, constexprs) in builds.items():
            # The other layer ops launch with Triton's default of 4 warps.
            warps = {
                "decode_partial": tiles.decode_num_warps,
                "prefill": tiles.prefill_num_warps,
                "add_rms_norm": layer_ops.norm_num_warps(LAYER_OPS_HIDDEN),
                "fp8_quantize": fp8_quant.quantize_num_warps(
                    fp8_quant.quantize_block(FP8_QUANT_COLS)
                ),
            }.get(name, 4)
            options = layer_ops.ROTARY_OPTIONS if name == "rotary" else {}
            compiled = _compile(fn, signature, constexprs, arch, warps, **options)
            ptx = compiled.asm["ptx"]
            registers, spill_bytes = _ptxas_report(ptx, arch)
            results.append(
                CompiledVariant(
                    kernel=name,
                    dtype=dtype,
                    head_dim=head_dim,
                    group=group,
                    block_size=block_size,
                    num_registers=registers,
                    spill_bytes=spill_bytes,
                    shared_bytes=compiled.metadata.shared,
                    float_fmas=len(re.findall(r"\bfma\.rn\.(?:bf16|f16|f32)\b", ptx)),
                )
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=tuple(DTYPES))
    parser.add_argument("--head-dims", nargs="+", type=int, default=HEAD_DIMS)
    args = parser.parse_args()
    for variant in compile_all(args.arch, tuple(args.dtypes), tuple(args.head_dims)):
        print(json.dumps(asdict(variant)))


if __name__ == "__main__":
    main()

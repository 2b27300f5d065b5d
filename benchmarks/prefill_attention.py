"""Prefill attention over the paged KV cache: every prefill kernel of the native backend.

    python benchmarks/prefill_attention.py [--dtype bfloat16] [--cache-dtype DTYPE]
                                           [--threads N] [--calls 15]

Times one layer's prefill attention of a step, on the small model's heads (12 query heads, 4
KV heads, head_dim 64, block size 16), with the engine's own start-up timer
(``prefill_kernel_timer``: fresh chunks, their K/V already in the cache): torch's ``sdpa`` and
``matmul`` over the padded chunks, and the native kernel in the CPU's variant (with a bf16 query:
on ``vdpbf16ps`` in ``avx512_bf16`` over a bf16 or ``float8_e5m2`` cache, on the tiles in ``amx``
over a bf16 one) and in ``avx512``, whose products are fp32 FMAs, where that is not the same.
Prints the best call of ``--calls`` in milliseconds, the kernels of a case interleaved so that
load from elsewhere falls on all. The variant is the CPU's best unless ``PDSERVE_NATIVE_ISA``
forces one (with oneDNN's ``ONEDNN_MAX_CPU_ISA=AVX512_CORE`` that emulates a host without AMX or
AVX512-BF16).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.host_memory import restart_with_huge_page_heap  # noqa: E402
from services.models.native_attention import NATIVE_PREFILL, NativePagedAttention  # noqa: E402
from services.models.native_build import native_kernel_error  # noqa: E402
from services.models.prefill_kernel_choice import KernelTimer, prefill_kernel_timer  # noqa: E402

# (chunks, tokens each): a step's budget of 2,048-2,304 tokens as short prompts, long ones and
# one whole prompt.
CASES = [(9, 256), (4, 512), (1, 2048)]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 12, 4, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--cache-dtype", default=None,
                        choices=["bfloat16", "float32", "float8_e5m2"],
                        help="the KV cache's dtype (default: --dtype)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--calls", type=int, default=15, help="timed calls per kernel")
    args = parser.parse_args()

    error = native_kernel_error()
    if error is not None:
        sys.exit(f"native kernels unavailable: {error}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cache_dtype = getattr(torch, args.cache_dtype or args.dtype)
    backend = NativePagedAttention(BLOCK_SIZE, HEAD_DIM**-0.5)
    # The native kernel's variants: the backend's own (amx where it would use it), its vector
    # one, and avx512's fp32 products beside those that multiply bf16 pairs.
    isas = dict.fromkeys([backend.prefill_isa, backend.isa])
    if backend.isa == "avx512_bf16":
        isas["avx512"] = None
    variants = {f"native {isa}": isa for isa in isas}
    names = ["sdpa", "matmul", *variants]

    print(
        f"{args.dtype} (cache {cache_dtype}), {torch.get_num_threads()} threads, {NUM_HEADS} q "
        f"heads / {NUM_KV_HEADS} kv heads x {HEAD_DIM}, block {BLOCK_SIZE}; best ms per layer "
        "call"
    )
    print(f"{'chunks x tokens':>16} " + " ".join(f"{name:>19}" for name in names))
    for num_chunks, tokens in CASES:
        time_call = prefill_kernel_timer(
            backend, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
            dtype=dtype, cache_dtype=cache_dtype, steps=[(num_chunks, tokens)],
        )  # fmt: skip

        def call(name: str, time_call: KernelTimer = time_call) -> float:
            backend.prefill_isa = variants.get(name, backend.prefill_isa)
            return time_call(NATIVE_PREFILL if name in variants else name)

        best = dict.fromkeys(names, float("inf"))
        for name in names:
            call(name)  # warm-up
        for _ in range(args.calls):
            for name in names:
                best[name] = min(best[name], call(name))
        row = " ".join(f"{best[name] * 1e3:>19.2f}" for name in names)
        print(f"{f'{num_chunks} x {tokens}':>16} {row}")


if __name__ == "__main__":
    restart_with_huge_page_heap()  # as the nodes run: services/host_memory.py
    main()

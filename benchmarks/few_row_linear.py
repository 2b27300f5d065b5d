"""Decode-sized linears: oneDNN's packed kernel against our few-row kernel on the same buffer.

    python benchmarks/few_row_linear.py [--dtype bfloat16|float32] [--layers 48]
        [--rows 1,16,32,64,128,256] [--threads N] [--trials 9]

Packs the ``small`` model's projections (qkv 768 -> 1280, o 768 -> 768, gate/up 768 -> 4096,
down 2048 -> 768) for ``--layers`` decoder layers, then times one pass over all of them per
row count with each kernel: ``mkldnn._linear_pointwise`` and our kernel for the dtype, which
reads the very buffer oneDNN packed (bf16: ``amx_linear.FewRowWeight`` on AMX, else
``bf16_linear.Bf16FewRowWeight`` on AVX512-BF16; fp32:
``fp32_linear.Fp32FewRowWeight``, in the variant ``PDSERVE_NATIVE_ISA`` forces or the CPU's
best). 48 layers' weights (604 MB in bf16) exceed the L3 of the hosts in
``docs/benchmarks.md``, so the default streams them from memory as a decode step does;
``--layers 2`` keeps them in the cache (the kernels' arithmetic alone). Prints the best of
``--trials`` passes (the two kernels' passes taking turns), the weight bytes streamed per second
and GFLOP/s. ``ONEDNN_MAX_CPU_ISA=AVX512_CORE`` (or ``AVX2``) holds oneDNN to what a CPU
without AMX (or AVX-512) has.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.host_memory import restart_with_huge_page_heap  # noqa: E402
from services.models.amx_linear import FewRowWeight, amx_unavailable_reason  # noqa: E402
from services.models.bf16_linear import (  # noqa: E402
    Bf16FewRowWeight,
    bf16_linear_unavailable_reason,
)
from services.models.fp32_linear import (  # noqa: E402
    Fp32FewRowWeight,
    fp32_linear_unavailable_reason,
)
from services.models.packed_linear import REORDER_BATCH_HINT  # noqa: E402

SHAPES = [(768, 1280), (768, 768), (768, 4096), (2048, 768)]
"""(in_features, out_features) of one decoder layer's projections in the small model."""


def best_seconds(fns: Sequence[Callable[[], object]], trials: int) -> list[float]:
    """The best of ``trials`` timed passes of each of ``fns``, their passes taking turns: on a
    shared host (a cloud VM's neighbours) the rate drifts by 20 % within a minute, and timing one
    kernel's passes after the other's put that drift into their ratio."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(trials):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--rows", default="1,16,32,64,128,256")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--trials", type=int, default=9, help="timed passes of each kernel")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    kernel: type[FewRowWeight | Fp32FewRowWeight]
    if dtype == torch.float32:
        kernel, name, reason = Fp32FewRowWeight, "ours", fp32_linear_unavailable_reason()
    elif amx_unavailable_reason() is None:
        kernel, name, reason = FewRowWeight, "AMX", None
    else:
        kernel, name, reason = Bf16FewRowWeight, "ours", bf16_linear_unavailable_reason()
    if reason is not None:
        sys.exit(f"our {args.dtype} kernel does not run here: {reason}")
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    packed: list[torch.Tensor] = []
    few_rows: list[FewRowWeight | Fp32FewRowWeight] = []
    for _ in range(args.layers):
        for in_features, out_features in SHAPES:
            weight = (torch.randn(out_features, in_features, generator=generator) / 32).to(dtype)
            packed.append(torch.ops.mkldnn._reorder_linear_weight(weight, REORDER_BATCH_HINT))
            view = kernel.of(weight, packed[-1])
            if view is None:
                sys.exit(f"oneDNN packed a {tuple(weight.shape)} weight in another layout")
            few_rows.append(view)
    in_sizes = [in_features for _ in range(args.layers) for in_features, _ in SHAPES]
    weights = args.layers * sum(i * o for i, o in SHAPES)
    weight_bytes = weights * dtype.itemsize
    print(
        f"{args.layers} layers, {weight_bytes / 1e6:.0f} MB of {args.dtype} weights, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"rows   oneDNN ms (GB/s, GFLOP/s)      {name} ms (GB/s, GFLOP/s)      speedup")
    for num_rows in (int(r) for r in args.rows.split(",")):
        inputs = {i: torch.randn(num_rows, i, generator=generator).to(dtype) for i, _ in SHAPES}

        xs = [inputs[size] for size in in_sizes]

        def onednn(xs: list[torch.Tensor] = xs) -> None:
            for weight, x in zip(packed, xs, strict=True):
                torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")

        def ours(xs: list[torch.Tensor] = xs) -> None:
            for view, x in zip(few_rows, xs, strict=True):
                view.linear(x)

        onednn_s, ours_s = best_seconds([onednn, ours], args.trials)
        flops = 2 * num_rows * weights
        print(
            f"{num_rows:4d}   {onednn_s * 1e3:7.2f} ({weight_bytes / onednn_s / 1e9:4.1f}, "
            f"{flops / onednn_s / 1e9:4.0f})"
            f"     {ours_s * 1e3:7.2f} ({weight_bytes / ours_s / 1e9:4.1f}, "
            f"{flops / ours_s / 1e9:4.0f})"
            f"     {onednn_s / ours_s:.2f}x"
        )


if __name__ == "__main__":
    restart_with_huge_page_heap()  # as the nodes run: services/host_memory.py
    main()

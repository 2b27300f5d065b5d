"""Decode-sized bf16 linears: oneDNN's packed kernel against our AMX kernel on the same buffer.

    python benchmarks/few_row_linear.py [--layers 48] [--rows 1,16,32,64,128,256] [--threads N]

Packs the ``small`` model's projections (qkv 768 -> 1280, o 768 -> 768, gate/up 768 -> 4096,
down 2048 -> 768) for ``--layers`` decoder layers, then times one pass over all of them per
row count with each kernel: ``mkldnn._linear_pointwise`` and ``amx_linear.FewRowWeight.linear``
(which reads the very buffer oneDNN packed). 48 layers' weights (604 MB) exceed the L3 of the
hosts in ``docs/benchmarks.md``, so the default streams them from memory as a decode step
does; ``--layers 2`` (25 MB) keeps them in the cache (the kernels' arithmetic alone). Prints the
best of five passes and the weight bytes streamed per second.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.models.amx_linear import FewRowWeight, amx_unavailable_reason  # noqa: E402

SHAPES = [(768, 1280), (768, 768), (768, 4096), (2048, 768)]
"""(in_features, out_features) of one decoder layer's projections in the small model."""


def best_seconds(fn: Callable[[], object], trials: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--rows", default="1,16,32,64,128,256")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    reason = amx_unavailable_reason()
    if reason is not None:
        sys.exit(f"the AMX kernel does not run here: {reason}")
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    packed: list[torch.Tensor] = []
    few_rows: list[FewRowWeight] = []
    for _ in range(args.layers):
        for in_features, out_features in SHAPES:
            weight = (torch.randn(out_features, in_features, generator=generator) / 32).bfloat16()
            packed.append(torch.ops.mkldnn._reorder_linear_weight(weight, 64))
            view = FewRowWeight.of(weight, packed[-1])
            if view is None:
                sys.exit(f"oneDNN packed a {tuple(weight.shape)} weight in another layout")
            few_rows.append(view)
    in_sizes = [in_features for _ in range(args.layers) for in_features, _ in SHAPES]
    weight_bytes = 2 * args.layers * sum(i * o for i, o in SHAPES)
    print(
        f"{args.layers} layers, {weight_bytes / 1e6:.0f} MB of bf16 weights, "
        f"{torch.get_num_threads()} threads"
    )
    print("rows   oneDNN ms (GB/s)    AMX ms (GB/s)    speedup")
    for num_rows in (int(r) for r in args.rows.split(",")):
        inputs = {i: torch.randn(num_rows, i, generator=generator).bfloat16() for i, _ in SHAPES}

        xs = [inputs[size] for size in in_sizes]

        def onednn(xs: list[torch.Tensor] = xs) -> None:
            for weight, x in zip(packed, xs, strict=True):
                torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")

        def amx(xs: list[torch.Tensor] = xs) -> None:
            for view, x in zip(few_rows, xs, strict=True):
                view.linear(x)

        onednn_s, amx_s = best_seconds(onednn), best_seconds(amx)
        print(
            f"{num_rows:4d}   {onednn_s * 1e3:7.2f} ({weight_bytes / onednn_s / 1e9:4.1f})"
            f"     {amx_s * 1e3:7.2f} ({weight_bytes / amx_s / 1e9:4.1f})"
            f"     {onednn_s / amx_s:.2f}x"
        )


if __name__ == "__main__":
    main()

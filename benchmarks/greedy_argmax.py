"""The greedy argmax of a decode step's logits on the CPU: torch's ``max(dim)`` against the native
kernel, and the float32 copy the sampler skips when nothing is applied to the logits.

    python benchmarks/greedy_argmax.py [--rows 64] [--vocab 32000,151936]

Prints milliseconds per call (best of five runs of 50 calls) for float32 and bfloat16 logits of
``--rows`` x each vocabulary size (32,000: the small model and Llama 2; 151,936: Qwen2/2.5).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.attention_kernels import best_ms  # noqa: E402
from services.models.layer_ops import LayerOps  # noqa: E402
from services.models.native_build import native_kernel_error  # noqa: E402
from services.models.native_layer_ops import NativeLayerOps  # noqa: E402

CALLS, TRIALS = 50, 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", default="32000,151936")
    args = parser.parse_args()
    error = native_kernel_error()
    if error is not None:
        sys.exit(f"native CPU kernels are unavailable: {error}")
    torch_ops, native_ops = LayerOps(), NativeLayerOps()
    print(f"{args.rows} rows, {torch.get_num_threads()} threads, native variant {native_ops.isa}")
    print("vocab     dtype      max(dim) ms   native ms   float32 copy ms")
    for vocab in (int(v) for v in args.vocab.split(",")):
        generator = torch.Generator().manual_seed(vocab)
        for dtype in (torch.float32, torch.bfloat16):
            logits = torch.randn(args.rows, vocab, generator=generator).to(dtype)
            if not torch.equal(native_ops.greedy_argmax(logits), logits.argmax(dim=-1)):
                sys.exit("the native argmax disagrees with torch's")
            torch_ms = best_ms(lambda: torch_ops.greedy_argmax(logits), CALLS, TRIALS)  # noqa: B023
            native_ms = best_ms(lambda: native_ops.greedy_argmax(logits), CALLS, TRIALS)  # noqa: B023
            copy_ms = best_ms(lambda: logits.to(torch.float32, copy=True), CALLS, TRIALS)  # noqa: B023
            name = str(dtype).removeprefix("torch.")
            print(f"{vocab:7d}   {name:9s}  {torch_ms:10.3f}   {native_ms:9.3f}   {copy_ms:10.3f}")


if __name__ == "__main__":
    main()

"""A GGUF file's projections kept as int8 codes on a CPU against the same weights dequantized
to fp32 (what ``--dtype auto`` loaded before): the linears alone, then the engine on a real file.

    python benchmarks/gguf_codes.py [--model models/SmolLM2-135M-Instruct] [--layers 48]
        [--rows 1,4,16,64,256,1024] [--trials 7] [--bits 4|8] [--batch-sizes 1,16,64]
        [--output-len 64]
        [--skip-linears] [--skip-engine]

Linears: the ``small`` model's projections (qkv 768 -> 1280, o 768 -> 768, gate/up 768 -> 4096,
down 2048 -> 768) for ``--layers`` decoder layers, random Q4_1 blocks (codes 0-15, a scale and
an offset per 32 inputs, as Q4_1, Q4_K and Q5_K files hold them; two a byte with ``--bits 4``,
as a 4-bit format's are kept), as ``GgufLinear`` and as
``PackedLinear`` over the dequantized fp32 weights (oneDNN, or the fp32 few-row kernel up to 64
rows); 48 layers' fp32 weights (1.2 GB) exceed the L3, so both stream from memory as a decode
step does. Prints the best of ``--trials`` passes (taking turns) per row count.

Engine: two ``LLM``s on the file (``PDSERVE_GGUF_CODES`` on, then 0), float32 by ``auto``: the
bytes of its weights, and greedy output tok/s of chat prompts
at each batch size, the two taking turns twice, best kept; outputs compared (they must be equal:
the kernel computes the fp32 kernel's sums).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.few_row_linear import best_seconds  # noqa: E402
from benchmarks.speculative_decoding import QUESTIONS  # noqa: E402
from services.engine import LLM, SamplingParams  # noqa: E402
from services.models.gguf_blocks import GgufBlocks  # noqa: E402
from services.models.gguf_linear import SWITCH_ENV, GgufLinear  # noqa: E402
from services.models.packed_linear import PackedLinear, PackedSiluGateUp  # noqa: E402

SHAPES = [(768, 1280), (768, 768), (768, 4096), (2048, 768)]
"""(in_features, out_features) of one decoder layer's projections in the small model."""


def q4_1_blocks(out_features: int, in_features: int, generator: torch.Generator) -> GgufBlocks:
    groups = in_features // 32
    return GgufBlocks(
        torch.randint(0, 16, (out_features, in_features), dtype=torch.int8, generator=generator),
        torch.rand(out_features, groups, generator=generator) / 64,
        -torch.rand(out_features, groups, generator=generator) / 8,
        32,
    )


def linears(layers: int, rows: list[int], trials: int, bits: int) -> None:
    generator = torch.Generator().manual_seed(0)
    codes: list[GgufLinear] = []
    dense: list[PackedLinear] = []
    for _ in range(layers):
        for in_features, out_features in SHAPES:
            blocks = q4_1_blocks(out_features, in_features, generator)
            module = GgufLinear(
                in_features, out_features, bias=False, group=32, offsets=True, bits=bits
            )
            module.fill(0, blocks)
            module.pack()
            codes.append(module)
            linear = torch.nn.Linear(in_features, out_features, bias=False)
            linear.weight.data = blocks.dequantize()
            dense.append(PackedLinear(linear))
    weights = sum(i * o for i, o in SHAPES) * layers
    code_bytes = sum(m.nbytes for m in codes)
    print(
        f"{layers} layers, {weights / 1e6:.0f} M weights: {bits}-bit codes "
        f"{code_bytes / 2**20:.0f} MiB, "
        f"fp32 {weights * 4 / 2**20:.0f} MiB; {torch.get_num_threads()} threads"
    )
    print("rows | codes ms | fp32 ms | fp32 / codes | codes GFLOP/s | fp32 GFLOP/s")
    for count in rows:
        x = {i: torch.randn(count, i) for i, _ in SHAPES}
        code_s, dense_s = best_seconds([partial(run, codes, x), partial(run, dense, x)], trials)
        flops = 2 * weights * count
        print(
            f"{count:4d} | {code_s * 1e3:8.2f} | {dense_s * 1e3:7.2f} | "
            f"{dense_s / code_s:12.2f} | {flops / code_s / 1e9:13.1f} | "
            f"{flops / dense_s / 1e9:12.1f}",
            flush=True,
        )


def run(modules: Sequence[GgufLinear] | Sequence[PackedLinear], x: dict[int, torch.Tensor]) -> None:
    """One pass over every layer's projections, each on ``x``'s rows of its input width."""
    for module in modules:
        module(x[module.in_features])


def weight_bytes(llm: LLM) -> int:
    """Bytes of the model's weights: its parameters (codes, scales and offsets included), plus
    the buffers packed linears hold outside them. (The process's resident size cannot tell:
    glibc's heap may sit on hugetlbfs pages, which it does not count.)"""
    model = llm.engine.runner.model
    packed = sum(
        module.num_weights * llm.engine.runner.dtype.itemsize
        for module in model.modules()
        if isinstance(module, PackedLinear | PackedSiluGateUp)
    )
    return packed + sum(p.nbytes for p in model.parameters())


def engine(model: Path, batch_sizes: list[int], output_len: int) -> None:
    llms: dict[str, LLM] = {}
    for name, switch in (("codes", "1"), ("fp32", "0")):
        os.environ[SWITCH_ENV] = switch
        llms[name] = LLM(model, dtype="auto", max_model_len=1024, kv_cache_memory=64 << 20)
        print(f"{name}: weights {weight_bytes(llms[name]) / 2**20:.0f} MiB")
    os.environ.pop(SWITCH_ENV)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    print("batch | codes tok/s | fp32 tok/s | codes / fp32 | same")
    for batch in batch_sizes:
        messages = [
            [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(batch)
        ]
        best: dict[str, float] = {}
        outputs: dict[str, list[list[int]]] = {}
        for round_index in range(2):
            order = ("codes", "fp32") if round_index % 2 == 0 else ("fp32", "codes")
            for name in order:
                start = time.perf_counter()
                results = llms[name].chat(messages, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                tokens = [r.outputs[0].token_ids for r in results]
                best[name] = max(best.get(name, 0.0), sum(len(t) for t in tokens) / seconds)
                outputs[name] = tokens
        same = sum(a == b for a, b in zip(outputs["codes"], outputs["fp32"], strict=True))
        print(
            f"{batch:5d} | {best['codes']:11.1f} | {best['fp32']:10.1f} | "
            f"{best['codes'] / best['fp32']:12.2f} | {same}/{batch}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--rows", default="1,4,16,64,256,1024")
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument(
        "--bits", type=int, choices=[4, 8], default=4, help="the linears' codes (4: as Q4 files')"
    )
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--skip-linears", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    if not args.skip_linears:
        linears(args.layers, [int(r) for r in args.rows.split(",")], args.trials, args.bits)
    if not args.skip_engine:
        engine(args.model, [int(b) for b in args.batch_sizes.split(",")], args.output_len)


if __name__ == "__main__":
    main()

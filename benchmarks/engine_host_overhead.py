"""The engine's host time per decode step, without the model: what a GPU waits for.

    python benchmarks/engine_host_overhead.py [--model models/tiny-llama] [--batch 64]
        [--steps 300]

On a GPU a graphed decode step of a small model takes ~1 ms of device time, and the engine's
pure-Python part of the step (scheduling, KV block bookkeeping, outputs, staging the graph's
inputs) runs while the GPU waits. This times that part on any host: ``--batch`` greedy
requests are prefilled, then the model runner's ``execute`` is replaced by a stub that returns a
token per request, and ``engine.step()`` is timed over ``--steps`` steps (median of 3 runs).
``StaticDecode``'s input staging (the CUDA-graph path's host side) is timed alone at the same
batch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.scheduler import SampledToken, SchedulerOutput  # noqa: E402


def stub_execute(
    output: SchedulerOutput,
) -> tuple[dict[str, list[SampledToken]], dict[str, list[object]], dict[str, list[float]]]:
    """One token (id 7) for every chunk that samples; no prompt logprobs, no embeddings."""
    tokens = {
        c.request.request_id: [SampledToken(7, None)] for c in output.chunks if c.needs_sample
    }
    return tokens, {}, {}


def time_steps(model: Path, batch: int, steps: int) -> float:
    """Seconds per ``engine.step()`` of ``batch`` decodes with the model stubbed out."""
    llm = LLM(model, dtype="float32", max_model_len=2048, max_num_seqs=batch)
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [16 + i % 64] * 128, params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    engine.runner.execute = stub_execute  # type: ignore[method-assign]
    for _ in range(20):
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps


def time_staging(model: Path, batch: int, repeats: int = 2000) -> float:
    """Seconds per ``StaticDecode._stage`` of ``batch`` decodes over 9-block tables."""
    llm = LLM(model, dtype="float32", max_model_len=1024, max_num_seqs=batch, cuda_graphs=True)
    static = llm.engine.runner.static_decode
    assert static is not None
    tables = [list(range(i * 9, i * 9 + 9)) for i in range(batch)]
    # No LoRA adapter slots (the engine has LoRA off).
    args = ([1] * batch, [140] * batch, [5] * batch, tables, (), static.bucket_for(batch) or batch)
    for _ in range(50):
        static._stage(*args)
    start = time.perf_counter()
    for _ in range(repeats):
        static._stage(*args)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models/tiny-llama")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    if not (args.model / "config.json").is_file():
        from services.models.tiny import build_tiny_model

        build_tiny_model(args.model, size="tiny")
    step = statistics.median(time_steps(args.model, args.batch, args.steps) for _ in range(3))
    staging = statistics.median(time_staging(args.model, args.batch) for _ in range(3))
    print(
        f"batch {args.batch}: engine.step() host time {step * 1e6:.0f} us "
        f"({step * 1e6 / args.batch:.1f} us a request); "
        f"graph input staging {staging * 1e6:.0f} us"
    )


if __name__ == "__main__":
    main()

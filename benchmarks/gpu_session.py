"""Everything pdserve measures on a GPU, in one command; writes JSON and prints a table.

    python benchmarks/gpu_session.py [--out benchmarks/results/gpu] [--model models/small-llama]
        [--dry-run] [--only versions,copy_bandwidth,...]

Stages (each one runs, or records why it cannot, and the session goes on):

1. ``versions``: Python, torch, Triton, CUDA, driver, GPU.
2. ``copy_bandwidth``: device-to-device copy of 1 GiB, GB/s (the roofline for everything below).
3. ``gpu_tests``: ``pytest -m gpu`` (kernels in bf16, graph replay vs eager, cache sizing).
4. ``kernels``: Triton decode attention vs the torch path at 4 sizes (12 query / 4 KV heads x
   64, block 16, bf16): time per call and TB/s of K/V read. Target: >= 70 % of copy bandwidth
   at 64 x 1,024 context.
5. ``decode_steps``: ``LLM`` on CUDA with and without CUDA graphs: decode step time at batch 1,
   16 and 64 against the bandwidth floor (weights + KV read once per step at the copy
   bandwidth). Target: batch 1 within 1.5x of the floor.
6. ``offline``: ``benchmarks/offline_throughput.py --device cuda`` on 256 x (512 in, 128 out)
   against transformers static batching. Target: >= 5x.
7. ``serving_burst``: ``benchmarks/serving_comparison.py --systems colocated`` with the node on
   the GPU (``PDSERVE_DEVICE``), a burst through the gateway.

``--dry-run`` (what the CPU test suite runs): stages that need CUDA say so instead of running,
and nothing slow starts; the JSON and the table are written the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.models.attention import AttentionMetadata, TorchPagedAttention  # noqa: E402

PYTHON = sys.executable
KERNEL_CASES = [(1, 256), (16, 512), (64, 320), (64, 1024)]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 12, 4, 64, 16
DECODE_BATCHES = (1, 16, 64)


class Skip(Exception):
    """A stage that cannot run here; its message says why."""


def need_cuda(args: argparse.Namespace) -> None:
    if not torch.cuda.is_available():
        raise Skip("needs CUDA (torch.cuda.is_available() is false)")
    if args.dry_run:
        raise Skip("dry run")


def cuda_time(fn: Callable[[], object], repeats: int = 20) -> float:
    """Median seconds per call, timed with CUDA events after a warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def stage_versions(args: argparse.Namespace) -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as exc:
        info["triton"] = f"not importable: {exc}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["capability"] = f"{props.major}.{props.minor}"
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError) as exc:
            info["driver"] = f"unknown ({exc})"
    return info


def stage_copy_bandwidth(args: argparse.Namespace) -> dict:
    need_cuda(args)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = cuda_time(lambda: dst.copy_(src))
    # A copy reads and writes every byte.
    return {"bytes": src.numel(), "seconds": seconds, "gb_per_s": 2 * src.numel() / seconds / 1e9}


def stage_gpu_tests(args: argparse.Namespace) -> dict:
    need_cuda(args)
    result = subprocess.run(
        [PYTHON, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    summary = result.stdout.strip().splitlines()[-1:] or ["(no output)"]
    return {"returncode": result.returncode, "summary": summary[0], "tail": result.stdout[-3000:]}


def make_decode_batch(num_seqs: int, context: int, dtype: torch.dtype, device: str):
    """A decode batch over blocks scattered in a cache twice its size."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = 2 * num_seqs * blocks_per_seq
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * blocks_per_seq]
    query = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=gen)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
        num_decodes=num_seqs,
        decode_block_tables=tables.view(num_seqs, blocks_per_seq).to(device),
        decode_seq_lens=torch.full((num_seqs,), context, dtype=torch.int64, device=device),
        prefills=[],
    )
    return query.to(device, dtype), cache.to(device, dtype), metadata


def time_decode_kernels(num_seqs: int, context: int, copy_gb_per_s: float | None) -> dict:
    from services.models.triton_attention import paged_decode

    query, cache, metadata = make_decode_batch(num_seqs, context, torch.bfloat16, "cuda")
    scale = HEAD_DIM**-0.5
    torch_path = TorchPagedAttention(BLOCK_SIZE, scale)
    out = torch.empty_like(query)
    tables, lens = metadata.decode_block_tables, metadata.decode_seq_lens
    times = {
        "torch": cuda_time(lambda: torch_path._decode(query, cache[0], cache[1], metadata)),
        "triton": cuda_time(
            lambda: paged_decode(out, query, cache[0], cache[1], tables, lens, scale)
        ),
    }
    expected = torch_path._decode(query, cache[0], cache[1], metadata)
    row = {
        "num_seqs": num_seqs,
        "context": context,
        "max_abs_err": (out.float() - expected.float()).abs().max().item(),
    }
    kv_bytes = 2 * num_seqs * context * NUM_KV_HEADS * HEAD_DIM * query.element_size()
    for name, seconds in times.items():
        row[f"{name}_us"] = seconds * 1e6
        row[f"{name}_tb_per_s"] = kv_bytes / seconds / 1e12
    if copy_gb_per_s:
        row["triton_share_of_copy_bw"] = row["triton_tb_per_s"] * 1e3 / copy_gb_per_s
    return row


def stage_kernels(args: argparse.Namespace, copy_gb_per_s: float | None) -> dict:
    need_cuda(args)
    rows = [time_decode_kernels(n, c, copy_gb_per_s) for n, c in KERNEL_CASES]
    return {"rows": rows}


def ensure_model(path: Path) -> Path:
    if not (path / "config.json").is_file():
        from services.models.tiny import build_tiny_model

        build_tiny_model(path, arch="llama", size="small")
    return path


def stage_decode_steps(args: argparse.Namespace, copy_gb_per_s: float | None) -> dict:
    need_cuda(args)
    from services.engine import LLM, SamplingParams

    model = ensure_model(args.model)
    rows = []
    prompt_len, steps = 128, 32
    for graphs in (False, True):
        llm = LLM(
            model,
            dtype="bfloat16",
            device="cuda",
            max_model_len=1024,
            max_num_seqs=max(DECODE_BATCHES),
            cuda_graphs=graphs,
            enable_prefix_caching=False,
        )
        engine = llm.engine
        weight_bytes = sum(p.nbytes for p in engine.runner.model.parameters())
        for batch in DECODE_BATCHES:
            params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
            for i in range(batch):
                engine.add_request(f"g{graphs}-b{batch}-{i}", [16 + i] * prompt_len, params)
            # Prefill everything first (each request has its first token), then time steps
            # that are pure decodes.
            started: set[str] = set()
            while len(started) < batch:
                started.update(o.request_id for o in engine.step() if o.new_token_ids)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
            step_s = (time.perf_counter() - start) / steps
            while engine.has_unfinished_requests:
                engine.step()
            kv_bytes = batch * (prompt_len + steps // 2) * engine.runner.block_bytes // BLOCK_SIZE
            row = {"cuda_graphs": graphs, "batch": batch, "step_ms": step_s * 1e3}
            if copy_gb_per_s:
                # A step reads every weight and the whole KV once; the copy figure counts read
                # + write traffic, the rate a pure read stream also reaches.
                floor_s = (weight_bytes + kv_bytes) / (copy_gb_per_s * 1e9)
                row["floor_ms"] = floor_s * 1e3
                row["x_floor"] = step_s / floor_s
            rows.append(row)
        del llm, engine
        torch.cuda.empty_cache()
    return {"rows": rows, "weight_bytes": weight_bytes}


def run_script(argv: list[str], env: dict[str, str] | None = None) -> dict:
    result = subprocess.run(
        [PYTHON, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **(env or {})},
    )
    return {"returncode": result.returncode, "tail": (result.stdout + result.stderr)[-3000:]}


def stage_offline(args: argparse.Namespace) -> dict:
    need_cuda(args)
    out = args.out / "offline.json"
    run = run_script(
        ["benchmarks/offline_throughput.py", "--model", str(ensure_model(args.model)),
         "--device", "cuda", "--num-prompts", "256", "--input-len", "512", "--output-len",
         "128", "--hf-batch-size", "64", "--json", str(out)],
    )  # fmt: skip
    if out.is_file():
        run["results"] = json.loads(out.read_text())
    return run


def stage_serving_burst(args: argparse.Namespace) -> dict:
    need_cuda(args)
    run = run_script(
        ["benchmarks/serving_comparison.py", "--model", str(ensure_model(args.model)),
         "--systems", "colocated", "--scenario", "burst", "--num-prompts", "256",
         "--input-len", "512", "--output-len", "128", "--kv-cache-memory", "8GiB",
         "--out", str(args.out / "serving")],
        env={"PDSERVE_DEVICE": "cuda"},
    )  # fmt: skip
    return run


STAGES = (
    "versions",
    "copy_bandwidth",
    "gpu_tests",
    "kernels",
    "decode_steps",
    "offline",
    "serving_burst",
)


def run_session(args: argparse.Namespace) -> dict[str, dict]:
    results: dict[str, dict] = {}

    def bandwidth() -> float | None:
        return results.get("copy_bandwidth", {}).get("result", {}).get("gb_per_s")

    runners: dict[str, Callable[[], dict]] = {
        "versions": lambda: stage_versions(args),
        "copy_bandwidth": lambda: stage_copy_bandwidth(args),
        "gpu_tests": lambda: stage_gpu_tests(args),
        "kernels": lambda: stage_kernels(args, bandwidth()),
        "decode_steps": lambda: stage_decode_steps(args, bandwidth()),
        "offline": lambda: stage_offline(args),
        "serving_burst": lambda: stage_serving_burst(args),
    }
    for name in STAGES:
        if args.only and name not in args.only:
            results[name] = {"status": "skipped", "reason": "not in --only"}
            continue
        start = time.perf_counter()
        try:
            results[name] = {"status": "ok", "result": runners[name]()}
        except Skip as why:
            results[name] = {"status": "skipped", "reason": str(why)}
        except Exception as exc:  # one stage's failure is recorded; the session goes on
            results[name] = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
        results[name]["seconds"] = round(time.perf_counter() - start, 2)
        print(f"[{name}] {results[name]['status']}", flush=True)
    return results


def table(results: dict[str, dict]) -> str:
    lines = ["| stage | status | summary |", "|---|---|---|"]
    for name, entry in results.items():
        if entry["status"] != "ok":
            summary = entry.get("reason", "")
        else:
            result = entry["result"]
            if "rows" in result:
                summary = "; ".join(
                    ", ".join(
                        f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in row.items()
                    )
                    for row in result["rows"]
                )
            else:
                summary = ", ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in result.items()
                    if k != "tail"
                )
        lines.append(f"| {name} | {entry['status']} | {summary} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/gpu")
    parser.add_argument("--model", type=Path, default=ROOT / "models/small-llama")
    parser.add_argument("--dry-run", action="store_true", help="CUDA stages say why, run nothing")
    parser.add_argument(
        "--only", type=lambda s: s.split(","), default=None, help=f"subset of {','.join(STAGES)}"
    )
    args = parser.parse_args(argv)
    if args.only and not set(args.only) <= set(STAGES):
        parser.error(f"--only: unknown stage(s) {sorted(set(args.only) - set(STAGES))}")
    args.out.mkdir(parents=True, exist_ok=True)
    results = run_session(args)
    (args.out / "session.json").write_text(json.dumps(results, indent=2))
    print(table(results))
    print(f"wrote {args.out / 'session.json'}")
    return 1 if any(e["status"] == "failed" for e in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

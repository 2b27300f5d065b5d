"""Everything pdserve measures on a GPU, in one command; writes JSON and prints a table.

    python benchmarks/gpu_session.py [--out benchmarks/results/gpu] [--model models/small-llama]
        [--dry-run] [--only versions,copy_bandwidth,...]

Stages (each one runs, or records why it cannot, and the session goes on):

1. ``versions``: Python, torch, Triton, CUDA, driver, GPU.
2. ``copy_bandwidth``: device-to-device copy of 1 GiB, GB/s (the roofline for everything below).
3. ``gpu_tests``: ``pytest -m gpu`` (kernels in bf16, graph replay vs eager, cache sizing).
4. ``kernels``: Triton decode attention vs the torch path at 4 sizes (12 query / 4 KV heads x
   64, block 16, bf16): time per call (launched from Python, and the Triton call replayed as a
   CUDA graph) and TB/s of K/V read. Target: the graphed kernel at >= 70 % of copy bandwidth
   at 64 x 1,024 context.
5. ``decode_steps``: ``LLM`` on CUDA: decode step time at batch 1, 16 and 64 against the
   bandwidth floor (weights + KV read once per step at the copy bandwidth), for the small
   model with and without CUDA graphs and the ~1B model (``tiny --size 1b``) with them, each
   graphed case with torch's elementwise ops and with the fused Triton ones
   (``PDSERVE_TRITON_LAYER_OPS``).
   Target: batch 1 within 1.5x of the floor.
5b. ``step_profile``: graphed decode steps (the small model at batch 1 and 64, the ~1B model
   at batch 1): graph replay alone against a whole engine step, a cProfile of the host side
   and the replayed graph's kernels by device time (``profile_{model}_b{batch}.txt``).
6. ``offline``: ``benchmarks/offline_throughput.py --device cuda`` on 256 x (512 in, 128 out)
   against transformers static batching, with a cProfile of pdserve's run
   (``profile_offline.txt``). Target: >= 5x.
6a. ``offline_budget``: pdserve alone on that workload at step budgets of 2,048 and 8,192
   tokens (``--max-num-batched-tokens``; the ``LLM``'s default on a GPU is 16,384), with a
   cProfile each.
6b. ``launcher``: ``python -m deploy.launch`` (``make run``) with a prefill and a decode node on
   GPU 0 (``gpu_ids``), a chat completion and a streamed completion through the gateway, then
   SIGTERM: exit code and log tail.
7. ``serving_burst``: ``benchmarks/serving_comparison.py --systems colocated`` with the node on
   the GPU (``PDSERVE_DEVICE``), a burst through the gateway.
7a. ``lora``: ``benchmarks/lora_overhead.py --device cuda`` on the ~1B model (64 prompts x 128
   in / 128 out, rank 16 on every projection): no LoRA, LoRA on with base requests, one adapter,
   two adapters; with decode graphs (the adapters' deltas replayed in them) and ``--eager``.

``--dry-run`` (what the CPU test suite runs): stages that need CUDA say so instead of running,
and nothing slow starts; the JSON and the table are written the same way.

On a CUDA image that has torch but not pdserve's other packages (no package index reachable
there), fetch their Python 3.12 wheels where one is, carry them over, and install them aside:

    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 \
        -d .whl -r benchmarks/gpu-extras.txt
    pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site

and carry the generated protobuf code (``make protos``: ``pdserve/v1/*_pb2*.py``) too.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.models.attention import AttentionMetadata, TorchPagedAttention  # noqa: E402
from services.models.backends import TRITON_LAYER_OPS_ENV  # noqa: E402

PYTHON = sys.executable
KERNEL_CASES = [(1, 256), (16, 512), (64, 320), (64, 1024)]
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 12, 4, 64, 16
DECODE_BATCHES = (1, 16, 64)


class Deadline:
    """The session's wall-clock budget: a stage starts only with ``reserve_s`` left, and a
    child process gets what is left, so the whole session ends inside the device lease."""

    def __init__(self, budget_s: float, reserve_s: float = 20.0) -> None:
        self.end = time.monotonic() + budget_s
        self.reserve_s = reserve_s

    def left(self) -> float:
        return max(1.0, self.end - time.monotonic() - self.reserve_s)

    def check(self) -> None:
        if self.end - time.monotonic() < 2 * self.reserve_s:
            raise Skip("the session's --budget-s ran out")


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


def gpu_test_files() -> list[str]:
    """The test modules that hold ``gpu``-marked tests: collecting only these keeps the stage
    free of the CPU suite's development-only imports."""
    return sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if "mark.gpu" in path.read_text()
    )


def stage_gpu_tests(args: argparse.Namespace) -> dict:
    need_cuda(args)
    result = subprocess.run(
        [PYTHON, "-m", "pytest", "-m", "gpu", "-q", "-rfE", "-p", "no:cacheprovider",
         "--timeout", "240", *gpu_test_files()],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=args.deadline.left(),
    )  # fmt: skip
    summary = result.stdout.strip().splitlines()[-1:] or ["(no output)"]
    return {"returncode": result.returncode, "summary": summary[0], "tail": result.stdout[-6000:]}


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

    def triton_call() -> None:
        paged_decode(out, query, cache[0], cache[1], tables, lens, scale)

    times = {
        "torch": cuda_time(lambda: torch_path._decode(query, cache[0], cache[1], metadata)),
        "triton": cuda_time(triton_call),
        # The same call replayed as a CUDA graph, as decode steps run it: the kernels' own time,
        # without Python launching them (~100 us a call eagerly, whatever the size).
        "triton_graph": cuda_time(capture(triton_call).replay),
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
        row["triton_share_of_copy_bw"] = row["triton_graph_tb_per_s"] * 1e3 / copy_gb_per_s
    return row


def capture(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """``fn`` captured as a CUDA graph, after a warm-up on a side stream (compiles, lazy init)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def stage_kernels(args: argparse.Namespace, copy_gb_per_s: float | None) -> dict:
    need_cuda(args)
    rows = [time_decode_kernels(n, c, copy_gb_per_s) for n, c in KERNEL_CASES]
    return {"rows": rows}


def ensure_model(path: Path, size: str = "small") -> Path:
    if not (path / "config.json").is_file():
        from services.models.tiny import build_tiny_model

        build_tiny_model(path, arch="llama", size=size)
    return path


def streamed_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: all of them but the input embedding, of which a
    step reads one row per token (unless it is tied to the output projection)."""
    total = sum(p.nbytes for p in model.parameters())
    embedding = model.model.embed_tokens.weight
    if embedding is getattr(model.lm_head, "weight", None):
        return total
    return total - embedding.nbytes


def decode_llm(model: Path, cuda_graphs: bool, quantization: str | None = None):  # -> LLM
    """The decode stages' engine: bf16 on the GPU (``quantization="fp8"``: fp8 projections),
    room for the largest batch, no prefix cache (every step decodes what it was given)."""
    from services.engine import LLM

    return LLM(
        model,
        dtype="bfloat16",
        device="cuda",
        max_model_len=1024,
        max_num_seqs=max(DECODE_BATCHES),
        cuda_graphs=cuda_graphs,
        enable_prefix_caching=False,
        quantization=quantization,
    )


def start_decodes(engine, batch: int, prompt_len: int, steps: int, tag: str) -> None:
    """``batch`` greedy requests of ``prompt_len`` tokens, stepped until each has its first
    token, so the steps that follow are pure decodes."""
    from services.engine import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [16 + i] * prompt_len, params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in engine.step() if o.new_token_ids)


def drain(engine) -> None:
    while engine.has_unfinished_requests:
        engine.step()


def stage_decode_steps(args: argparse.Namespace, copy_gb_per_s: float | None) -> dict:
    """Decode step time against the bandwidth floor: the small model eager and with CUDA
    graphs, and the ~1B model with graphs."""
    need_cuda(args)

    rows = []
    # (size, checkpoint, CUDA graphs, fused Triton layer ops): each model with torch's
    # elementwise ops and with the fused kernels, which are opt-in until measured here.
    cases = [
        ("small", args.model, False, False),
        ("small", args.model, True, False),
        ("small", args.model, True, True),
        ("1b", args.model_1b, True, False),
        ("1b", args.model_1b, True, True),
    ]
    for size, path, graphs, fused in cases:
        args.deadline.check()
        os.environ[TRITON_LAYER_OPS_ENV] = "1" if fused else "0"
        try:
            llm = decode_llm(ensure_model(path, size), graphs)
        finally:
            os.environ.pop(TRITON_LAYER_OPS_ENV)
        rows += decode_step_rows(
            llm.engine,
            {"model": size, "cuda_graphs": graphs, "fused_ops": fused},
            copy_gb_per_s,
        )
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return {"rows": rows}


def decode_step_rows(engine, label: dict, copy_gb_per_s: float | None) -> list[dict]:
    """One row per batch of ``DECODE_BATCHES``: the mean decode step time of ``engine`` over
    32 steps of requests with 128-token prompts, and the bandwidth floor of such a step."""
    prompt_len, steps = 128, 32
    weight_bytes = streamed_weight_bytes(engine.runner.model)
    rows = []
    for batch in DECODE_BATCHES:
        tag = "-".join(str(v) for v in (*label.values(), batch))
        start_decodes(engine, batch, prompt_len, steps, tag)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        step_s = (time.perf_counter() - start) / steps
        drain(engine)
        kv_bytes = batch * (prompt_len + steps // 2) * engine.runner.block_bytes // BLOCK_SIZE
        row = {**label, "batch": batch, "step_ms": step_s * 1e3, "weight_mb": weight_bytes / 1e6}
        if copy_gb_per_s:
            # A step reads the weights and the whole KV once; the copy figure counts read
            # + write traffic, the rate a pure read stream also reaches.
            floor_s = (weight_bytes + kv_bytes) / (copy_gb_per_s * 1e9)
            row["floor_ms"] = floor_s * 1e3
            row["x_floor"] = step_s / floor_s
        rows.append(row)
    return rows


FP8_GEMM_SHAPES = ((2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048))
"""(in, out) of the ~1B model's projections: fused QKV, O, fused gate/up, down."""


def time_fp8_gemms() -> list[dict]:
    """Microseconds a call, replayed 50 to a graph as a decode graph replays them, of each part
    of an fp8 projection against bf16's one GEMM, at the ~1B model's shapes and decode batches:
    the input's quantization, the GEMM with a scale per row (what ``Fp8Linear`` runs), the GEMM
    with one scale per operand (cuBLASLt's), and the whole projection."""
    return [
        fp8_gemm_row(k, n, m) for (k, n), m in itertools.product(FP8_GEMM_SHAPES, DECODE_BATCHES)
    ]


def fp8_gemm_row(k: int, n: int, m: int) -> dict:
    from services.models.fp8_checkpoint import quantize_rows
    from services.models.fp8_linear import Fp8Linear
    from services.models.triton_fp8_quant import quantize_input_triton

    def per_call(fn: Callable[[], object], calls: int = 50) -> float:
        graph = capture(lambda: [fn() for _ in range(calls)])
        return cuda_time(graph.replay) / calls * 1e6

    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    linear = Fp8Linear(k, n, bias=False).cuda()
    linear.fill(0, quantize_rows(weight))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    q, x_scale = quantize_input_triton(x, None)
    one = torch.ones((), device="cuda")
    w_t, w_scale = linear.weight.t(), linear.weight_scale.view(1, -1)
    bf16 = torch.bfloat16
    return {
        "in": k,
        "out": n,
        "rows": m,
        "bf16_us": per_call(lambda: torch.nn.functional.linear(x, weight)),
        "quantize_us": per_call(lambda: quantize_input_triton(x, None)),
        "rowwise_gemm_us": per_call(
            lambda: torch._scaled_mm(q, w_t, scale_a=x_scale, scale_b=w_scale, out_dtype=bf16)
        ),
        "tensorwise_gemm_us": per_call(
            lambda: torch._scaled_mm(q, w_t, scale_a=one, scale_b=one, out_dtype=bf16)
        ),
        "fp8_projection_us": per_call(lambda: linear(x)),
    }


def stage_fp8(args: argparse.Namespace, copy_gb_per_s: float | None) -> dict:
    """fp8 projections (``quantization="fp8"``, quantized per row at load) against bf16 on the
    ~1B model, both with graphs and the fused ops: decode step time against the floor, how far
    greedy outputs agree, and offline throughput."""
    need_cuda(args)
    from services.engine import SamplingParams

    gemms = time_fp8_gemms()
    path = ensure_model(args.model_1b, "1b")
    rows: list[dict] = []
    tokens: dict[str, list[list[int]]] = {}
    prompts = [[16 + (7 * i + j) % 1000 for j in range(96)] for i in range(16)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for quantization in (None, "fp8"):
        args.deadline.check()
        name = quantization or "bf16"
        llm = decode_llm(path, True, quantization)
        rows += decode_step_rows(llm.engine, {"model": "1b", "weights": name}, copy_gb_per_s)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[name] = [list(o.outputs[0].token_ids) for o in outputs]
        del llm, outputs
        gc.collect()
        torch.cuda.empty_cache()
    agree = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
        for x, y in zip(tokens["bf16"], tokens["fp8"], strict=True)
    ]
    offline = {}
    for quantization in (None, "fp8"):
        out = args.out / f"offline_1b_{quantization or 'bf16'}.json"
        run = run_script(
            ["benchmarks/offline_throughput.py", "--model", str(path), "--device", "cuda",
             "--num-prompts", "256", "--input-len", "512", "--output-len", "128", "--skip-hf",
             "--json", str(out), *(["--quantization", quantization] if quantization else [])],
            args.deadline,
        )  # fmt: skip
        if out.is_file():
            run["results"] = json.loads(out.read_text())["pdserve"]
        offline[quantization or "bf16"] = run
    return {
        "rows": rows,
        "gemms": gemms,
        "greedy_tokens_equal_before_first_difference": agree,
        "offline": offline,
    }


def stage_step_profile(args: argparse.Namespace) -> dict:
    """Where a graphed decode step's time goes: the graph replay alone (device time, CUDA
    events) against a whole ``engine.step()``, and a cProfile of the host side with the
    replayed graph's kernels by device time, written to ``profile_{model}_b{batch}.txt``: the
    small model at batch 1 and 64, the ~1B model at batch 1 (issue 8's 1.5x target)."""
    need_cuda(args)
    rows = []
    for size, path, batches in (("small", args.model, (1, 64)), ("1b", args.model_1b, (1,))):
        args.deadline.check()
        llm = decode_llm(ensure_model(path, size), cuda_graphs=True)
        for batch in batches:
            row = profile_graphed_step(llm.engine, batch, args.out / f"profile_{size}_b{batch}.txt")
            rows.append({"model": size, "batch": batch, **row})
        # Every reference to the engine's memory goes before the next model or stage.
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return {"rows": rows}


def profile_graphed_step(engine, batch: int, out: Path) -> dict:
    import cProfile
    import io
    import pstats

    steps = 64
    static = engine.runner.static_decode
    start_decodes(engine, batch, 128, steps, f"profile-b{batch}")
    graph = static._graphs[static.bucket_for(batch), False]
    replay_s = cuda_time(graph.replay)
    profile = cProfile.Profile()
    torch.cuda.synchronize()
    start = time.perf_counter()
    profile.enable()
    for _ in range(steps):
        engine.step()
    profile.disable()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - start) / steps
    drain(engine)
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    # The device side: each kernel of the replayed graph, by total time (what a fused or
    # faster kernel would save), under torch's profiler.
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as kernels:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    text.write("\n\nKernels of 10 graph replays\n")
    text.write(kernels.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    out.write_text(text.getvalue())
    return {"replay_ms": replay_s * 1e3, "profiled_step_ms": step_s * 1e3}


def run_script(argv: list[str], deadline: Deadline, env: dict[str, str] | None = None) -> dict:
    result = subprocess.run(
        [PYTHON, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        # The scripts import the project's packages from the checkout, installed or not.
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            **(env or {}),
        },
        timeout=deadline.left(),
    )
    return {"returncode": result.returncode, "tail": (result.stdout + result.stderr)[-3000:]}


def stage_kv_transfer(args: argparse.Namespace) -> dict:
    need_cuda(args)
    return run_script(
        ["benchmarks/kv_transfer.py", "--transports", "cuda_ipc", "--sizes-mib", "64",
         "--rounds", "2", "--no-perftest"],
        args.deadline,
    )  # fmt: skip


def stage_offline(args: argparse.Namespace) -> dict:
    need_cuda(args)
    out = args.out / "offline.json"
    run = run_script(
        ["benchmarks/offline_throughput.py", "--model", str(ensure_model(args.model)),
         "--device", "cuda", "--num-prompts", "256", "--input-len", "512", "--output-len",
         "128", "--hf-batch-size", "64", "--json", str(out),
         "--profile", str(args.out / "profile_offline.txt")],
        args.deadline,
    )  # fmt: skip
    if out.is_file():
        run["results"] = json.loads(out.read_text())
    return run


OFFLINE_BUDGETS = (2048, 8192)
"""Step token budgets the ``offline_budget`` stage runs pdserve at, beside the ``offline``
stage's default (16,384 on a GPU): smaller prefill steps launch more eager kernels."""


def stage_offline_budget(args: argparse.Namespace) -> dict:
    """pdserve alone on the ``offline`` stage's workload at the smaller step budgets of
    ``OFFLINE_BUDGETS`` (compare with that stage's pdserve and transformers figures, at the
    ``LLM``'s GPU default, taken minutes apart on the same GPU)."""
    need_cuda(args)
    runs = {}
    for budget in OFFLINE_BUDGETS:
        out = args.out / f"offline_{budget}.json"
        run = run_script(
            ["benchmarks/offline_throughput.py", "--model", str(ensure_model(args.model)),
             "--device", "cuda", "--num-prompts", "256", "--input-len", "512", "--output-len",
             "128", "--skip-hf", "--max-num-batched-tokens", str(budget), "--json", str(out),
             "--profile", str(args.out / f"profile_offline_{budget}.txt")],
            args.deadline,
        )  # fmt: skip
        if out.is_file():
            run["results"] = json.loads(out.read_text())
        runs[str(budget)] = run
    return runs


def launch_and_ask(model: Path, gpu_ids: list[int], work: Path, deadline: Deadline) -> dict:
    """``python -m deploy.launch`` (what ``make run`` starts) on a topology that puts one
    prefill and one decode node on ``gpu_ids`` (empty: the CPU), then one chat completion and
    one streamed completion through the gateway's HTTP API; the launcher is stopped with
    SIGTERM and its exit code and log tail recorded."""
    import urllib.error
    import urllib.request

    import yaml

    from deploy.local_ports import free_ports

    http, grpc_port, prefill_port, decode_port = free_ports(4)
    pins = {"gpu_ids": gpu_ids} if gpu_ids else {}
    # Two nodes share one GPU here: each gets its own cache size, not 0.9 of the device.
    node_args = {"kv-cache-memory": "4GiB" if gpu_ids else "256MiB"}
    topology = {
        "model": str(model),
        "served_model_name": "model",
        "dtype": "bfloat16" if gpu_ids else "float32",
        "prefill": {"count": 1, "base_grpc_port": prefill_port, "args": node_args, **pins},
        "decode": {"count": 1, "base_grpc_port": decode_port, "args": node_args, **pins},
        "gateway": {"http_port": http, "grpc_port": grpc_port},
    }
    work.mkdir(parents=True, exist_ok=True)
    path = work / "topology.yaml"
    path.write_text(yaml.safe_dump(topology))
    log = (work / "launcher.log").open("w")
    launcher = subprocess.Popen(
        [PYTHON, "-m", "deploy.launch", "--topology", str(path), "--grace-s", "10"],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{http}"

    def post(route: str, body: dict) -> tuple[int, str]:
        request = urllib.request.Request(
            base + route, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=min(60.0, deadline.left())) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    result: dict = {"topology": topology}
    started = time.monotonic()
    try:
        ready_by = started + min(240.0, deadline.left())
        while time.monotonic() < ready_by and launcher.poll() is None:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1)
        else:
            raise RuntimeError(f"the gateway never became healthy (launcher: {launcher.poll()})")
        result["ready_s"] = round(time.monotonic() - started, 1)
        chat = {"model": "model", "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": "Name three prime numbers."}]}  # fmt: skip
        status, body = post("/v1/chat/completions", chat)
        result["chat"] = {"status": status, "body": body[:600]}
        stream = {"model": "model", "prompt": "The capital of France is", "max_tokens": 16,
                  "stream": True}  # fmt: skip
        status, body = post("/v1/completions", stream)
        result["stream"] = {"status": status, "data_lines": body.count("data: "),
                            "done": body.rstrip().endswith("data: [DONE]")}  # fmt: skip
    finally:
        launcher.send_signal(signal.SIGTERM)
        try:
            result["exit_code"] = launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            result["exit_code"] = "killed after 60 s"
        log.close()
        result["log_tail"] = (work / "launcher.log").read_text()[-3000:]
    return result


def stage_launcher(args: argparse.Namespace) -> dict:
    """``make run``'s launcher with both nodes pinned to GPU 0 (``gpu_ids``)."""
    need_cuda(args)
    return launch_and_ask(ensure_model(args.model), [0], args.out / "launcher", args.deadline)


def stage_lora(args: argparse.Namespace) -> dict:
    need_cuda(args)
    runs = {}
    for name, extra in (("graphs", []), ("eager", ["--eager"])):
        runs[name] = run_script(
            ["benchmarks/lora_overhead.py", "--model", str(ensure_model(args.model_1b, "1b")),
             "--device", "cuda", "--num-prompts", "64", "--input-len", "128", "--output-len",
             "128", "--kv-cache-memory", "4GiB", "--dtype", "bfloat16", *extra],
            args.deadline,
        )  # fmt: skip
    return runs


def stage_serving_burst(args: argparse.Namespace) -> dict:
    need_cuda(args)
    run = run_script(
        ["benchmarks/serving_comparison.py", "--model", str(ensure_model(args.model)),
         "--systems", "colocated,disaggregated@auto", "--scenario", "burst",
         "--num-prompts", "256", "--input-len", "512", "--output-len", "128",
         "--kv-cache-memory", "8GiB", "--out", str(args.serving_out or args.out / "serving")],
        args.deadline,
        env={"PDSERVE_DEVICE": "cuda"},
    )  # fmt: skip
    return run


SPECULATIVE_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
"""A trained model for the ``speculative`` stage (a random one keeps no proposal): ``make
model``'s, carried to the device machine under ``models/``."""


def stage_speculative(args: argparse.Namespace) -> dict:
    """Speculative decoding against the plain engine on the GPU (greedy outputs compared),
    with decode graphs; needs SmolLM2 (``SPECULATIVE_MODEL``)."""
    need_cuda(args)
    if not SPECULATIVE_MODEL.exists():
        raise Skip(f"{SPECULATIVE_MODEL.relative_to(ROOT)} is not here (make model)")
    return run_script(
        ["benchmarks/speculative_decoding.py", "--model", str(SPECULATIVE_MODEL), "--device",
         "cuda", "--batch-sizes", "1,16,64", "--rounds", "2"],
        args.deadline,
    )  # fmt: skip


# The stages that start their own processes run before those that build an LLM in this one, so
# they find the GPU's memory free.
STAGES = (
    "versions",
    "copy_bandwidth",
    "gpu_tests",
    "kernels",
    "kv_transfer",
    "offline",
    "offline_budget",
    "launcher",
    "serving_burst",
    "lora",
    "speculative",
    "decode_steps",
    "fp8",
    "step_profile",
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
        "kv_transfer": lambda: stage_kv_transfer(args),
        "decode_steps": lambda: stage_decode_steps(args, bandwidth()),
        "step_profile": lambda: stage_step_profile(args),
        "offline": lambda: stage_offline(args),
        "offline_budget": lambda: stage_offline_budget(args),
        "launcher": lambda: stage_launcher(args),
        "serving_burst": lambda: stage_serving_burst(args),
        "lora": lambda: stage_lora(args),
        "speculative": lambda: stage_speculative(args),
        "fp8": lambda: stage_fp8(args, bandwidth()),
    }
    for name in STAGES:
        if args.only and name not in args.only:
            results[name] = {"status": "skipped", "reason": "not in --only"}
            continue
        start = time.perf_counter()
        try:
            args.deadline.check()
            results[name] = {"status": "ok", "result": runners[name]()}
        except Skip as why:
            results[name] = {"status": "skipped", "reason": str(why)}
        except Exception as exc:  # one stage's failure is recorded; the session goes on
            results[name] = {
                "status": "failed",
                "reason": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-4000:],
            }
        results[name]["seconds"] = round(time.perf_counter() - start, 2)
        print(f"[{name}] {results[name]['status']} in {results[name]['seconds']} s", flush=True)
        # Written after every stage: a session cut off by the lease still leaves its results.
        (args.out / "session.json").write_text(json.dumps(results, indent=2))
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
    parser.add_argument("--model-1b", type=Path, default=ROOT / "models/1b-llama")
    parser.add_argument(
        "--serving-out", type=Path, default=None, help="serving_burst's results (OUT/serving)"
    )
    parser.add_argument("--dry-run", action="store_true", help="CUDA stages say why, run nothing")
    parser.add_argument(
        "--budget-s", type=float, default=3600.0, help="wall-clock budget for the whole session"
    )
    parser.add_argument(
        "--only", type=lambda s: s.split(","), default=None, help=f"subset of {','.join(STAGES)}"
    )
    args = parser.parse_args(argv)
    if args.only and not set(args.only) <= set(STAGES):
        parser.error(f"--only: unknown stage(s) {sorted(set(args.only) - set(STAGES))}")
    args.out.mkdir(parents=True, exist_ok=True)
    args.deadline = Deadline(args.budget_s)
    results = run_session(args)
    (args.out / "session.json").write_text(json.dumps(results, indent=2))
    print(table(results))
    print(f"wrote {args.out / 'session.json'}")
    return 1 if any(e["status"] == "failed" for e in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

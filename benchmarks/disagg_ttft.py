"""TTFT of the disaggregated path for one long prompt, and where its time goes.

    python benchmarks/disagg_ttft.py [--model models/small-llama] [--prompt-len 2000] [--runs 8]

Starts a prefill node and a decode node as processes (bf16, KV over UCX), then, one request at
a time, plays the gateway: open Decode.Generate (the reservation), call Prefill with it and time
the call until the first token is back (the TTFT a client sees, less the gateway). Every prompt
is fresh random tokens, so the prefix cache never helps. Prints TTFT and the prefill node's
stage timings (queue, compute, push) for each run, then their medians.
"""

from __future__ import annotations

import argparse
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.local_ports import free_ports
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc


def start_node(module: str, role: str, args: argparse.Namespace, cpus: str | None):
    port = free_ports(1)[0]
    command = [
        sys.executable, "-m", module, "--role", role, "--model", str(args.model),
        "--dtype", "bfloat16", "--host", "127.0.0.1", "--grpc-port", str(port),
        "--kv-transport", "ucx", "--kv-cache-memory", "256MiB",
        "--max-model-len", str(args.prompt_len + 64), *args.node_flags,
    ]  # fmt: skip
    if cpus:
        command = ["taskset", "-c", cpus, *command]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(address)
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            request = health_pb2.HealthCheckRequest(service="")
            if health.Check(request, timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                return process, address, channel
        except grpc.RpcError:
            time.sleep(0.5)
    raise SystemExit(f"{module} did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("models/small-llama"))
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--prefill-cpus", default=None, help="taskset list, e.g. 0")
    parser.add_argument("--decode-cpus", default=None, help="taskset list, e.g. 1")
    parser.add_argument("node_flags", nargs="*", help="extra flags for both nodes (after --)")
    args = parser.parse_args()
    prefill, prefill_address, prefill_channel = start_node(
        "prefill_node", "prefill", args, args.prefill_cpus
    )
    decode, decode_address, decode_channel = start_node(
        "decode_node", "decode", args, args.decode_cpus
    )
    prefill_stub = prefill_pb2_grpc.PrefillServiceStub(prefill_channel)
    decode_stub = decode_pb2_grpc.DecodeServiceStub(decode_channel)
    sampling = common_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    rows = []
    try:
        for run in range(args.runs + 1):  # run 0 warms up
            prompt = [rng.randrange(5, 4000) for _ in range(args.prompt_len)]
            stream = decode_stub.Generate(
                decode_pb2.GenerateRequest(
                    request_id=f"ttft-{run}",
                    prompt_token_ids=prompt,
                    sampling=sampling,
                    kv_source=prefill_address,
                    lease_ms=60_000,
                ),
                timeout=120,
            )
            reservation = next(stream).reservation
            started = time.perf_counter()
            result = prefill_stub.Prefill(
                prefill_pb2.PrefillRequest(
                    request_id=f"ttft-{run}",
                    prompt_token_ids=prompt,
                    sampling=sampling,
                    destination=reservation,
                    decode_target=decode_address,
                ),
                timeout=120,
            )
            ttft = time.perf_counter() - started
            for _ in stream:
                pass
            t = result.timings
            row = (ttft, t.prefill_queue_s, t.prefill_compute_s, t.kv_transfer_s)
            if run:
                rows.append(row)
            print(
                f"run {run}: ttft {ttft * 1e3:8.1f} ms  queue {row[1] * 1e3:6.1f}  "
                f"compute {row[2] * 1e3:8.1f}  push {row[3] * 1e3:6.1f} ms"
                + ("  (warm-up)" if not run else "")
            )
        medians = [statistics.median(column) * 1e3 for column in zip(*rows, strict=True)]
        print(
            f"median of {len(rows)}: ttft {medians[0]:.1f} ms  queue {medians[1]:.1f}  "
            f"compute {medians[2]:.1f}  push {medians[3]:.1f} ms"
        )
    finally:
        for process in (prefill, decode):
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)


if __name__ == "__main__":
    main()

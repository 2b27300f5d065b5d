"""Soak: N concurrent streams against a running gateway for M minutes, with random
cancellations, then a report of what was lost and what leaked.

    python benchmarks/soak.py --base-url http://127.0.0.1:8000 --model tiny-llama \
        --duration-s 600 --concurrency 16 --cancel-prob 0.2 \
        --node prefill-0=127.0.0.1:50061 --node decode-0=127.0.0.1:50071 \
        --process gateway=PID --process prefill-0=PID ... [--json OUT.json]

Each stream sends a streamed completion with a random prompt and output length; with
probability ``--cancel-prob`` it hangs up after a random number of chunks. Reported: requests
completed and cancelled, errors by reason (HTTP status or error event), the resident memory of
each ``--process`` after a warm-up and at the end, and each ``--node``'s KV blocks in use once
the load stops (GetLoad; it must return to zero). Only loopback addresses are loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import grpc
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc  # noqa: E402

_LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass
class SoakReport:
    duration_s: float
    completed: int = 0
    cancelled: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    rss_mib_start: dict[str, float] = field(default_factory=dict)
    rss_mib_end: dict[str, float] = field(default_factory=dict)
    blocks_in_use_end: dict[str, int] = field(default_factory=dict)

    @property
    def rss_growth_mib(self) -> dict[str, float]:
        return {
            name: round(self.rss_mib_end[name] - start, 1)
            for name, start in self.rss_mib_start.items()
            if name in self.rss_mib_end
        }

    def to_dict(self) -> dict:
        return {**asdict(self), "rss_growth_mib": self.rss_growth_mib}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for pid {pid}")


async def blocks_in_use(nodes: dict[str, str]) -> dict[str, int]:
    used = {}
    for name, address in nodes.items():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = (
                prefill_pb2_grpc.PrefillServiceStub(channel)
                if name.startswith("prefill")
                else decode_pb2_grpc.DecodeServiceStub(channel)
            )
            used[name] = (await stub.GetLoad(common_pb2.GetLoadRequest(), timeout=5)).kv_blocks_used
    return used


async def one_stream(
    client: httpx.AsyncClient, args: argparse.Namespace, rng: random.Random, report: SoakReport
) -> None:
    prompt = [rng.randrange(16, 1000) for _ in range(rng.randint(1, args.max_input_len))]
    request = {
        "model": args.model, "prompt": prompt, "max_tokens": rng.randint(1, args.max_output_len),
        "stream": True, "ignore_eos": True, "temperature": rng.choice([0.0, 0.8]),
    }  # fmt: skip
    cancel_after = rng.randint(0, 8) if rng.random() < args.cancel_prob else None
    try:
        async with client.stream("POST", "/v1/completions", json=request) as response:
            if response.status_code != 200:
                await response.aread()
                reason = f"http_{response.status_code}"
                report.errors[reason] = report.errors.get(reason, 0) + 1
                return
            chunks = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    report.completed += 1
                    return
                event = json.loads(data)
                if "error" in event:
                    reason = f"event_{event['error'].get('type', 'error')}"
                    report.errors[reason] = report.errors.get(reason, 0) + 1
                chunks += 1
                if cancel_after is not None and chunks >= cancel_after:
                    report.cancelled += 1
                    return
            report.errors["no_done"] = report.errors.get("no_done", 0) + 1
    except httpx.HTTPError as exc:
        reason = type(exc).__name__
        report.errors[reason] = report.errors.get(reason, 0) + 1


async def soak(args: argparse.Namespace) -> SoakReport:
    host = urlparse(args.base_url).hostname
    if host not in _LOCAL_HOSTS:
        raise SystemExit(f"--base-url must be a loopback address, got {host!r}")
    processes = dict(item.split("=", 1) for item in args.process)
    nodes = dict(item.split("=", 1) for item in args.node)
    report = SoakReport(duration_s=args.duration_s)
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.request_timeout_s) as client:
        # Warm-up, so first-use allocations are not counted as growth.
        warmup = SoakReport(duration_s=0)
        await asyncio.gather(*(one_stream(client, args, rng, warmup) for _ in range(8)))
        report.rss_mib_start = {name: rss_mib(int(pid)) for name, pid in processes.items()}
        deadline = time.monotonic() + args.duration_s

        async def worker(seed: int) -> None:
            worker_rng = random.Random(seed)
            while time.monotonic() < deadline:
                await one_stream(client, args, worker_rng, report)

        await asyncio.gather(*(worker(rng.randrange(2**32)) for _ in range(args.concurrency)))
    report.rss_mib_end = {name: rss_mib(int(pid)) for name, pid in processes.items()}
    settle = time.monotonic() + 10  # cancelled streams leave their engines within a step
    while True:
        report.blocks_in_use_end = await blocks_in_use(nodes)
        if not any(report.blocks_in_use_end.values()) or time.monotonic() > settle:
            break
        await asyncio.sleep(0.1)
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--duration-s", type=float, default=60)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--cancel-prob", type=float, default=0.2)
    parser.add_argument("--max-input-len", type=int, default=200)
    parser.add_argument("--max-output-len", type=int, default=64)
    parser.add_argument("--request-timeout-s", type=float, default=120)
    parser.add_argument("--node", action="append", default=[], help="NAME=HOST:PORT (GetLoad)")
    parser.add_argument("--process", action="append", default=[], help="NAME=PID (RSS)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    report = asyncio.run(soak(args))
    result = report.to_dict()
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    leaked = {name: n for name, n in report.blocks_in_use_end.items() if n}
    sys.exit(1 if leaked else 0)


if __name__ == "__main__":
    main()

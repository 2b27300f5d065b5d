"""``python -m deploy.launch``: runs a topology on this machine — nodes and gateway as child
processes — waits until each is healthy and the gateway sees every node healthy, prints where
to reach it, supervises them, and stops everything on Ctrl-C / SIGTERM / SIGHUP (a second Ctrl-C
skips the drain).

Supervising: a process that dies once everything was up is restarted with back-off while the
others keep serving (the gateway fails over meanwhile); one that keeps dying (``--restart-budget``
restarts within ``--restart-window-s``) is reported and left down. ``--restart-budget 0`` only
reports deaths.

``make run`` calls it. The topology comes from ``--topology FILE`` (default: one prefill and one
decode node), then the flags below override the file. Exit code: 0 after a requested stop, 1 when
a process failed to start or every process was left down, 2 for a bad topology or a taken port.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import math
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from deploy.certs import write_deployment
from deploy.commands import ProcessSpec, connect_host, local_processes
from deploy.restarts import RestartBook, RestartPolicy
from deploy.supervisor import Output, Supervisor
from deploy.topology import (
    DEFAULT_BASE_PORTS,
    DTYPES,
    KV_CACHE_DTYPES,
    KV_TRANSPORTS,
    Role,
    Topology,
    load_topology,
)

LAUNCH = "launch"


def positive_seconds(text: str) -> float:
    seconds = float(text)
    if not math.isfinite(seconds) or seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return seconds


def non_negative_seconds(text: str) -> float:
    seconds = float(text)
    if not math.isfinite(seconds) or seconds < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return seconds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--topology", type=Path, help="topology YAML (deploy/topology.example.yaml)")
    add("--model", help="Hugging Face model directory or GGUF file (default: models/tiny-llama)")
    add("--served-model-name", help="name clients send (default: the directory's or file's name)")
    add(
        "--dtype",
        choices=DTYPES,
        help="compute dtype of every node; auto: on CPU the faster of bfloat16 and float32, "
        "measured once per CPU (default auto)",
    )
    add(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        help="dtype of every node's KV cache (default auto; fp8_e5m2 on CPU nodes only)",
    )
    add("--kv-transport", choices=KV_TRANSPORTS, help="KV transport between nodes (default auto)")
    add("--prefill", type=int, metavar="N", help="number of prefill nodes (default 1)")
    add("--decode", type=int, metavar="N", help="number of decode nodes (default 1)")
    add("--colocated", type=int, metavar="N", help="number of colocated nodes (default 0)")
    add("--host", help="address every server binds (default 127.0.0.1)")
    add("--http-port", type=int, help="gateway OpenAI HTTP port (default 8000)")
    add("--grpc-port", type=int, help="gateway public gRPC port (default 50051)")
    for role in Role:
        add(
            f"--{role}-port",
            type=int,
            metavar="PORT",
            help=f"first {role} node's gRPC port; node i listens on PORT + i "
            f"(default {DEFAULT_BASE_PORTS[role]})",
        )
        add(
            f"--{role}-metrics-port",
            type=int,
            metavar="PORT",
            help=f"first {role} node's Prometheus /metrics port; node i serves on PORT + i "
            "(default: none served)",
        )
    add("--no-gateway", action="store_true", help="run the nodes only (to develop the gateway)")
    add(
        "--startup-timeout-s",
        type=positive_seconds,
        default=600.0,
        help="how long every process may take to become healthy, and the gateway to see every "
        "node healthy (model loading; default %(default)g)",
    )
    add(
        "--tls",
        action="store_true",
        help="mutual TLS between all processes and TLS on the gateway's public ports, with "
        "certificates generated into --tls-dir",
    )
    add(
        "--tls-dir",
        type=Path,
        help="where --tls writes the CA and certificates (default: a temporary directory, "
        "removed at exit)",
    )
    add(
        "--grace-s",
        type=non_negative_seconds,
        default=40.0,
        help="after SIGTERM, how long a process may drain before SIGKILL (default %(default)g)",
    )
    add(
        "--restart-budget",
        type=int,
        default=5,
        help="restarts of one process allowed within --restart-window-s; past it the process "
        "is reported and left down (0: never restart; default %(default)d)",
    )
    add(
        "--restart-window-s",
        type=positive_seconds,
        default=300.0,
        help="the window --restart-budget counts in (default %(default)g)",
    )
    add(
        "--restart-backoff-s",
        type=non_negative_seconds,
        default=1.0,
        help="first delay before a restart; doubles with each death in the window, up to 30 s "
        "(default %(default)g)",
    )
    return parser


def topology_from_args(args: argparse.Namespace) -> Topology:
    topology = load_topology(args.topology) if args.topology else Topology()
    # Any: each key is a different field of Topology (or GatewaySpec below).
    top: dict[str, Any] = {}
    for key in ("model", "served_model_name", "dtype", "kv_cache_dtype", "host", "kv_transport"):
        if getattr(args, key) is not None:
            top[key] = getattr(args, key)
    gateway: dict[str, Any] = {}
    for key in ("http_port", "grpc_port"):
        if getattr(args, key) is not None:
            gateway[key] = getattr(args, key)
    if gateway:
        top["gateway"] = dataclasses.replace(topology.gateway, **gateway)
    for role in Role:
        ports = {
            "base_grpc_port": getattr(args, f"{role}_port"),
            "base_metrics_port": getattr(args, f"{role}_metrics_port"),
        }
        given: dict[str, Any] = {key: port for key, port in ports.items() if port is not None}
        if given:
            top[str(role)] = dataclasses.replace(topology.group(role), **given)
    topology = dataclasses.replace(topology, **top)
    return topology.with_counts(prefill=args.prefill, decode=args.decode, colocated=args.colocated)


def bind_family(host: str) -> socket.AddressFamily:
    """The address family servers bound to ``host`` use; raises ``ValueError`` naming the
    host when it does not resolve or is no address of this machine."""
    where = f"host {host!r} (--host, HOST=, topology host)"
    family = socket.AF_INET
    try:
        # IPv4 first, as the servers resolve a name; IPv6 for an address only it has (::1).
        for family in (socket.AF_INET, socket.AF_INET6):
            try:
                socket.getaddrinfo(host or "0.0.0.0", 0, family, socket.SOCK_STREAM)
                break
            except socket.gaierror:
                if family == socket.AF_INET6:
                    raise
        with socket.socket(family) as sock:
            sock.bind((host, 0))
    except socket.gaierror:
        raise ValueError(f"{where}: cannot resolve it") from None
    except OSError as exc:
        if exc.errno != errno.EADDRNOTAVAIL:
            raise
        raise ValueError(
            f"{where} is not an address of this machine: bind 127.0.0.1, 0.0.0.0 or one of its "
            "own addresses"
        ) from None
    return family


def taken_ports(topology: Topology, with_gateway: bool) -> list[int]:
    """Ports something already listens on. gRPC servers bind with SO_REUSEPORT, so a stale node
    would share the port silently instead of failing: better to refuse up front."""
    family = bind_family(topology.host)
    ports = [node.grpc_port for node in topology.nodes]
    ports += [n.metrics_port for n in topology.nodes if n.metrics_port is not None]
    if with_gateway:
        ports += [topology.gateway.http_port, topology.gateway.grpc_port]
    taken = []
    for port in ports:
        with socket.socket(family) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((topology.host, port))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                taken.append(port)
    return taken


class Launcher:
    def __init__(
        self,
        topology: Topology,
        specs: Sequence[ProcessSpec],
        *,
        grace_s: float,
        startup_timeout_s: float,
        output: Output,
        tls_dir: Path | None = None,
        restarts: RestartPolicy | None = None,
    ) -> None:
        self.restarts = RestartBook(restarts or RestartPolicy())
        self.topology = topology
        self.tls_dir = tls_dir
        """Where --tls put the certificates (the banner's commands use its CA); None: no TLS."""
        self.specs = list(specs)
        self.startup_timeout_s = startup_timeout_s
        self.output = output
        self.supervisor = Supervisor(output, grace_s=grace_s)
        self.stop_requested = threading.Event()

    def log(self, message: str) -> None:
        self.output.write_line("", f"[{LAUNCH}] {message}")

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.stop_requested.is_set():
            self.supervisor.force.set()
            return
        self.log(f"{signal.Signals(signum).name}: stopping (again to skip the drain)")
        self.stop_requested.set()

    def run(self) -> int:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, self.on_signal)
        exit_code = 0
        try:
            self.supervisor.start(self.specs)  # inside: a failed spawn still stops the others
            for child in self.supervisor.children:
                argv = shlex.join(child.spec.argv)
                self.log(f"started {child.spec.name} pid {child.pid}: {argv}")
            if self.wait_healthy():
                self.log(self.banner())
                exit_code = self.watch()
            elif not self.stop_requested.is_set():
                exit_code = 1
        finally:
            codes = self.supervisor.stop(first=("gateway",))
            summary = ", ".join(f"{name} {code}" for name, code in codes.items())
            self.log(f"stopped (exit codes: {summary})")
        return exit_code

    def wait_healthy(self) -> bool:
        start = time.monotonic()
        pending = {spec.name: [*spec.health, *spec.startup] for spec in self.specs}
        waiting_for: dict[str, str] = {}  # name -> what its first pending target said last
        while pending:
            if self.stop_requested.is_set():
                return False
            dead = self.supervisor.exited()
            if dead:
                for child in dead:
                    self.log(
                        f"{child.spec.name} exited with {child.process.returncode} "
                        "before it was healthy"
                    )
                return False
            if time.monotonic() - start > self.startup_timeout_s:
                waiting = "; ".join(
                    f"{name} (waiting for {waiting_for.get(name) or targets[0]})"
                    for name, targets in pending.items()
                )
                self.log(f"not healthy after {self.startup_timeout_s:.0f} s: {waiting}")
                return False
            for name, targets in list(pending.items()):
                while targets:
                    waiting_for[name] = targets[0].waiting_for(timeout_s=1.0)
                    if waiting_for[name]:
                        break
                    targets.pop(0)
                if not targets:
                    del pending[name]
                    self.log(f"{name} healthy after {time.monotonic() - start:.1f} s")
            self.stop_requested.wait(0.25)
        return True

    def watch(self) -> int:
        """Until a stop is requested (0), or every process was left down (1). A child that dies
        is restarted after its back-off; one past its restart budget is left down."""
        due: dict[str, float] = {}  # name -> when to restart it
        left_down: set[str] = set()
        recovering: dict[str, float] = {}  # restarted, not yet healthy: name -> restart time
        while not self.stop_requested.wait(0.25):
            now = time.monotonic()
            for child in self.supervisor.exited():
                name = child.spec.name
                if name in due or name in left_down:
                    continue
                recovering.pop(name, None)
                delay = self.restarts.died(name, now)
                code = child.process.returncode
                if delay is None:
                    left_down.add(name)
                    self.log(
                        f"{name} exited with {code} and keeps dying "
                        f"({self.restarts.policy.budget} restarts within "
                        f"{self.restarts.policy.window_s:.0f} s): leaving it down; the others "
                        "keep serving"
                    )
                else:
                    due[name] = now + delay
                    self.log(f"{name} exited with {code}; restarting it in {delay:.1f} s")
            if len(left_down) == len(self.supervisor.children):
                self.log("every process is down")
                return 1
            for name, when in list(due.items()):
                if now >= when:
                    del due[name]
                    child = self.supervisor.restart(name)
                    recovering[name] = now
                    self.log(
                        f"restarted {name} pid {child.pid} (restart {self.restarts.restarts(name)})"
                    )
            for name, since in list(recovering.items()):
                child = next(c for c in self.supervisor.children if c.spec.name == name)
                if child.is_alive and all(t.check(timeout_s=1.0) for t in child.spec.health):
                    del recovering[name]
                    self.log(f"{name} healthy again after {time.monotonic() - since:.1f} s")
        return 0

    def banner(self) -> str:
        t = self.topology
        host = connect_host(t)
        nodes = ", ".join(f"{n.name} {host}:{n.grpc_port}" for n in t.nodes)
        counts = ", ".join(
            f"{g.count} {g.role}" for g in (t.prefill, t.decode, t.colocated) if g.count
        )
        # With dtype auto each node chooses on its own host; its log says what ("compute dtype").
        lines = [
            f"pdserve is up: {counts}, model {t.model_name}, dtype {t.dtype}",
            f"  nodes: {nodes}",
        ]
        if any(spec.name == "gateway" for spec in self.specs):
            scheme = "http" if self.tls_dir is None else "https"
            http = f"{scheme}://{host}:{t.gateway.http_port}"
            curl_tls = "" if self.tls_dir is None else f" --cacert {self.tls_dir / 'ca.crt'}"
            grpcurl_tls = (
                "-plaintext" if self.tls_dir is None else f"-cacert {self.tls_dir / 'ca.crt'}"
            )
            body = f'{{"model": "{t.model_name}", "prompt": "Hello, my name is", "max_tokens": 16}}'
            lines += [
                f"  OpenAI HTTP API: {http}/v1   (health {http}/health, metrics {http}/metrics)",
                f"  gRPC API:        {host}:{t.gateway.grpc_port}   "
                "(pdserve.v1.GatewayService, reflection on)",
                "  try:",
                f"    curl{curl_tls} {http}/v1/completions -H 'Content-Type: application/json' \\",
                f"      -d '{body}'",
                f'    grpcurl {grpcurl_tls} -d \'{{"text": "Hello", "sampling": '
                f'{{"max_tokens": 16}}}}\' {host}:{t.gateway.grpc_port} '
                "pdserve.v1.GatewayService/Generate",
            ]
        lines.append("  Ctrl-C stops everything.")
        return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        topology = topology_from_args(args)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    with_gateway = not args.no_gateway
    if not Path(topology.model).exists():  # a checkpoint directory or a GGUF file, as the nodes
        parser.error(
            f"model {topology.model} does not exist: give a model directory or a GGUF file "
            "(make model builds the tiny one and fetches SmolLM2)"
        )
    try:
        taken = taken_ports(topology, with_gateway)
    except ValueError as exc:
        parser.error(str(exc))
    if taken:
        parser.error(
            f"port(s) {taken} on {topology.host} are in use (another pdserve?); "
            "choose others with --http-port/--grpc-port/--<role>-port/--<role>-metrics-port or "
            "a topology (make run: HTTP_PORT=, GRPC_PORT=, PREFILL_PORT=, DECODE_PORT=, "
            "COLOCATED_PORT=, PREFILL_METRICS_PORT=, DECODE_METRICS_PORT=, "
            "COLOCATED_METRICS_PORT=)"
        )
    try:
        restarts = RestartPolicy(
            budget=args.restart_budget,
            window_s=args.restart_window_s,
            initial_backoff_s=args.restart_backoff_s,
            max_backoff_s=max(30.0, args.restart_backoff_s),
        )
    except ValueError as exc:
        parser.error(str(exc))
    tls_dir = None
    if args.tls:
        # A directory of our own holds private keys that are good for this run only: it goes
        # when the launcher exits. One the user named is theirs and stays.
        if args.tls_dir is not None and args.tls_dir.exists() and not args.tls_dir.is_dir():
            parser.error(f"--tls-dir {args.tls_dir} is not a directory")
        tls_dir = args.tls_dir or Path(tempfile.mkdtemp(prefix="pdserve-tls-"))
        names = ["gateway", *(node.name for node in topology.nodes)]
        try:
            write_deployment(tls_dir, names, sans=[connect_host(topology)])
        except OSError as exc:
            if args.tls_dir is None:
                shutil.rmtree(tls_dir, ignore_errors=True)
            parser.error(f"--tls-dir {tls_dir}: cannot write the certificates: {exc}")
        print(f"[{LAUNCH}] TLS on: CA and certificates in {tls_dir}", flush=True)
    try:
        specs = local_processes(topology, with_gateway=with_gateway, tls_dir=tls_dir)
        launcher = Launcher(
            topology,
            specs,
            grace_s=args.grace_s,
            startup_timeout_s=args.startup_timeout_s,
            output=Output(sys.stdout),
            tls_dir=tls_dir,
            restarts=restarts,
        )
        return launcher.run()
    finally:
        if tls_dir is not None and args.tls_dir is None:
            shutil.rmtree(tls_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

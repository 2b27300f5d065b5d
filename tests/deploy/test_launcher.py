"""``python -m deploy.launch`` as a user runs it: start a topology with the tiny model, wait for
health, serve, stop on a signal, and leave no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from deploy.health import grpc_serving, http_json
from deploy.local_ports import free_ports

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
UP = "pdserve is up"
NODE_ARGS = {"kv-cache-memory": "16MiB", "max-model-len": 256, "drain-grace-s": 2}


def process_state(pid: int) -> str | None:
    """The /proc state letter, or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def is_running(pid: int) -> bool:
    return process_state(pid) not in (None, "Z")  # a zombie has ended; only its parent lags


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


class Launched:
    """One launcher process; its output is collected line by line."""

    def __init__(self, args: list[str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "deploy.launch", *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "NO_COLOR": "1"},
        )
        self.lines: list[str] = []
        self.is_up = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))
            if UP in line:
                self.is_up.set()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_up(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.is_up.wait(0.2):
            assert self.process.poll() is None, f"launcher exited:\n{self.output}"
            assert time.monotonic() < deadline, f"not up in {timeout_s} s:\n{self.output}"

    def child_pids(self) -> dict[str, int]:
        found = re.findall(r"\[launch\] started (\S+) pid (\d+)", self.output)
        return {name: int(pid) for name, pid in found}

    def wait(self, timeout_s: float = 60) -> int:
        code = self.process.wait(timeout=timeout_s)
        self.reader.join(timeout=10)
        return code

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def assert_all_gone(pids: dict[str, int], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = {n: p for n, p in pids.items() if is_running(p) or group_members(p)}
        if not left:
            return
        time.sleep(0.2)
    raise AssertionError(f"still running: {left}")


@pytest.fixture
def launch(tiny_llama_dir: Path, tmp_path: Path) -> Iterator:
    started: list[Launched] = []

    def start(topology: dict, *extra: str) -> Launched:
        path = tmp_path / f"topology-{len(started)}.yaml"
        path.write_text(yaml.safe_dump({"model": str(tiny_llama_dir), "dtype": "float32",
                                        "served_model_name": "tiny-llama",
                                        **topology}))  # fmt: skip
        launched = Launched(["--topology", str(path), "--grace-s", "20", *extra])
        started.append(launched)
        return launched

    yield start
    for launched in started:
        pids = launched.child_pids()
        launched.kill()
        for pid in pids.values():  # a failed test must not leak nodes into the next ones
            for member in [pid, *group_members(pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(member, signal.SIGKILL)


def pair(ports: list[int]) -> dict:
    return {
        "prefill": {"base_grpc_port": ports[0], "args": NODE_ARGS},
        "decode": {"base_grpc_port": ports[1], "args": NODE_ARGS},
    }


def test_nodes_start_healthy_log_with_prefixes_and_stop_on_sigterm(launch) -> None:
    ports = free_ports(2)
    launched = launch(pair(ports), "--no-gateway")
    launched.wait_up()
    pids = launched.child_pids()
    assert set(pids) == {"prefill-0", "decode-0"}
    for port in ports:
        assert grpc_serving(f"127.0.0.1:{port}")
    assert any(line.startswith("[prefill-0]") for line in launched.lines)
    assert any(line.startswith("[decode-0]") and "ready on port" in line for line in launched.lines)

    launched.process.send_signal(signal.SIGTERM)
    assert launched.wait() == 0, launched.output
    assert "exit codes: prefill-0 0, decode-0 0" in launched.output  # both drained, not killed
    assert_all_gone(pids, timeout_s=5)


def test_a_gguf_file_is_served_and_a_missing_model_is_refused(launch, tiny_gguf_factory) -> None:
    """``--model`` takes what the nodes take: a GGUF file as well as a directory."""
    gguf = tiny_gguf_factory("llama")
    port = free_ports(1)[0]
    colocated_only = {
        "prefill": {"count": 0},
        "decode": {"count": 0},
        "colocated": {"count": 1, "base_grpc_port": port, "args": NODE_ARGS},
    }
    launched = launch(colocated_only, "--no-gateway", "--model", str(gguf))
    launched.wait_up()
    assert grpc_serving(f"127.0.0.1:{port}")
    launched.process.send_signal(signal.SIGTERM)
    assert launched.wait() == 0, launched.output

    missing = gguf.with_name("missing.gguf")
    refused = launch(colocated_only, "--no-gateway", "--model", str(missing))
    assert refused.wait() == 2
    assert f"model {missing} does not exist" in refused.output
    assert "started" not in refused.output


def test_certificates_the_launcher_generated_for_itself_are_removed_at_exit(launch) -> None:
    """``--tls`` without ``--tls-dir``: the private keys live as long as the run."""
    port = free_ports(1)[0]
    colocated_only = {
        "prefill": {"count": 0},
        "decode": {"count": 0},
        "colocated": {"count": 1, "base_grpc_port": port, "args": NODE_ARGS},
    }
    launched = launch(colocated_only, "--no-gateway", "--tls")
    launched.wait_up()
    (tls_dir,) = re.findall(r"CA and certificates in (\S+)", launched.output)
    assert (Path(tls_dir) / "ca.crt").is_file()
    launched.process.send_signal(signal.SIGTERM)
    assert launched.wait() == 0, launched.output
    assert not Path(tls_dir).exists()


def test_a_launcher_killed_outright_takes_its_children_with_it(launch) -> None:
    (port,) = free_ports(1)
    launched = launch({"prefill": {"count": 0}, "decode": {"count": 0},
                       "colocated": {"count": 1, "base_grpc_port": port, "args": NODE_ARGS}},
                      "--no-gateway")  # fmt: skip
    launched.wait_up()
    pids = launched.child_pids()
    launched.process.send_signal(signal.SIGKILL)  # no chance to clean up: PR_SET_PDEATHSIG
    launched.wait()
    assert_all_gone(pids)


def complete_once(http_port: int) -> bool:
    """One short completion through the gateway; whether it succeeded."""
    body = {"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with no_proxy.open(request, timeout=60) as response:
            return json.load(response)["usage"]["completion_tokens"] == 4
    except OSError:
        return False


def test_a_killed_node_of_either_role_is_restarted_and_the_survivors_keep_serving(
    launch,
) -> None:
    """``make run PREFILL=2 DECODE=2``, then kill -9 of a decode node and of a prefill node:
    the launcher keeps the rest running, new requests succeed through the survivors, and the
    dead node comes back. Polled, never timed."""
    # Two nodes per role, numbered from each group's base port.
    prefill_port, _, decode_port, _, http_port, grpc_port = free_ports(6, consecutive=True)
    topology = {
        "prefill": {"count": 2, "base_grpc_port": prefill_port, "args": NODE_ARGS},
        "decode": {"count": 2, "base_grpc_port": decode_port, "args": NODE_ARGS},
        "gateway": {"http_port": http_port, "grpc_port": grpc_port,
                    "args": {"health-interval-s": 0.3}},
    }  # fmt: skip
    launched = launch(topology, "--restart-backoff-s", "0.2")
    launched.wait_up()
    # The banner waits until the gateway has polled both pairs healthy, not only the first.
    body = http_json(f"http://127.0.0.1:{http_port}/health")
    assert isinstance(body, dict), body
    assert body["nodes"]["prefill"] == body["nodes"]["decode"] == {"healthy": 2, "total": 2}
    pids = launched.child_pids()
    assert complete_once(http_port)
    for victim in ("decode-0", "prefill-1"):
        os.kill(pids[victim], signal.SIGKILL)
        deadline = time.monotonic() + 180
        while not complete_once(http_port):  # served by the survivors (or the restarted one)
            assert launched.process.poll() is None, launched.output
            assert time.monotonic() < deadline, launched.output
            time.sleep(0.2)
        while f"{victim} healthy again" not in launched.output:
            assert launched.process.poll() is None, launched.output
            assert time.monotonic() < deadline, launched.output
            time.sleep(0.2)
        assert f"{victim} exited with -9; restarting it in" in launched.output
        new_pid = int(re.findall(rf"restarted {victim} pid (\d+)", launched.output)[-1])
        assert new_pid != pids[victim] and is_running(new_pid)
        pids[victim] = new_pid
    survivors = ("prefill-0", "decode-1", "gateway")
    assert all(f"restarted {name}" not in launched.output for name in survivors)
    assert complete_once(http_port)
    launched.process.send_signal(signal.SIGTERM)
    assert launched.wait() == 0, launched.output
    assert_all_gone(pids, timeout_s=5)


def test_a_taken_port_is_refused_before_anything_starts(launch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        launched = launch(pair([port, free_ports(1)[0]]), "--no-gateway")
        assert launched.wait() == 2
    assert f"port(s) [{port}]" in launched.output and "started" not in launched.output


def gateway_available() -> str | None:
    """Why the end-to-end test cannot run yet, or None."""
    if not (REPO / "gateway" / "__main__.py").exists():
        return "the gateway has not landed yet (no gateway/__main__.py)"
    try:
        from pdserve.v1 import gateway_pb2_grpc  # noqa: F401
    except ImportError:
        return "no generated gateway stubs (make protos)"
    return None


def test_gateway_and_nodes_serve_http_and_grpc_then_stop_cleanly(launch) -> None:
    reason = gateway_available()
    if reason is not None:
        pytest.skip(reason)
    from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

    http_port, grpc_port, prefill_port, decode_port = free_ports(4)
    launched = launch({**pair([prefill_port, decode_port]),
                       "gateway": {"http_port": http_port, "grpc_port": grpc_port}})  # fmt: skip
    launched.wait_up()
    pids = launched.child_pids()
    assert set(pids) == {"prefill-0", "decode-0", "gateway"}
    assert f"curl http://127.0.0.1:{http_port}/v1/completions" in launched.output

    # ignore_eos: the tiny model's random weights may pick EOS early; length is what is tested.
    body = {"model": "tiny-llama", "prompt": "Hello, my name is", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with no_proxy.open(request, timeout=60) as response:
        completion = json.load(response)
    assert completion["choices"][0]["finish_reason"] == "length"
    assert completion["usage"]["completion_tokens"] == 8

    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        events = list(
            stub.Generate(
                gateway_pb2.GatewayGenerateRequest(
                    text="Hello, my name is",
                    sampling=common_pb2.SamplingParams(
                        max_tokens=8, temperature=0.0, ignore_eos=True
                    ),
                ),
                timeout=60,
            )
        )
    token_ids = [t for e in events if e.HasField("delta") for t in e.delta.token_ids]
    assert len(token_ids) == 8
    assert events[-1].HasField("finished") and events[-1].finished.usage.completion_tokens == 8

    launched.process.send_signal(signal.SIGINT)  # Ctrl-C
    assert launched.wait() == 0, launched.output
    assert_all_gone(pids, timeout_s=5)


def test_tls_wires_every_process_and_plaintext_is_refused(launch, tmp_path: Path) -> None:
    """``--tls`` (``make run TLS=1``): certificates generated, nodes refuse a plaintext probe but
    answer one with a deployment certificate, the gateway serves HTTPS end to end."""
    import ssl

    from deploy.commands import tls_files

    reason = gateway_available()
    if reason is not None:
        pytest.skip(reason)
    http_port, grpc_port, prefill_port, decode_port = free_ports(4)
    tls_dir = tmp_path / "tls"
    launched = launch({**pair([prefill_port, decode_port]),
                       "gateway": {"http_port": http_port, "grpc_port": grpc_port}},
                      "--tls", "--tls-dir", str(tls_dir))  # fmt: skip
    launched.wait_up()
    assert f"curl --cacert {tls_dir / 'ca.crt'} https://127.0.0.1:{http_port}" in launched.output
    for name, port in (("prefill-0", prefill_port), ("decode-0", decode_port)):
        assert not grpc_serving(f"127.0.0.1:{port}", timeout_s=10)
        assert grpc_serving(f"127.0.0.1:{port}", timeout_s=10, tls=tls_files(tls_dir, name))

    body = {"model": "tiny-llama", "prompt": "Hello, my name is", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    request = urllib.request.Request(
        f"https://127.0.0.1:{http_port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    context = ssl.create_default_context(cafile=str(tls_dir / "ca.crt"))
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
    )
    with opener.open(request, timeout=60) as response:
        completion = json.load(response)
    assert completion["usage"]["completion_tokens"] == 8  # through prefill and decode over mTLS

    pids = launched.child_pids()
    launched.process.send_signal(signal.SIGINT)
    assert launched.wait() == 0, launched.output
    assert_all_gone(pids, timeout_s=5)

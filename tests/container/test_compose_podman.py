"""The CPU compose deployment built and run for real under podman, Envoy in front: a streamed chat
completion with the ``openai`` client and gRPC calls through Envoy, a decode container killed
while requests keep succeeding (the gateway retries on the other decode node; podman's restart
policy brings the killed one back), and ``down`` leaving no container, network or volume.

Runs when podman is installed and the images are already built (the images are kept between
runs), or when asked with ``PDSERVE_CONTAINER_TESTS=1`` (``make test-container``), which also
installs podman with apt-get when missing and run as root. A cold build (base images, torch)
takes longer than CI can spare; ``docs/containers.md`` gives measured times.

The topology takes free ports, so it never collides with ``make up`` or anything else running;
the project name (the container prefix) is the test's own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from deploy.local_ports import free_ports
from deploy.podman import LABEL

REPO = Path(__file__).resolve().parents[2]
PROJECT = f"pdserve-ctest-{os.getpid()}"
IMAGES = ("localhost/pdserve-node-cpu", "localhost/pdserve-gateway", "localhost/pdserve-envoy")
UP_TIMEOUT_S = 1500
"""A cold build on a loaded 2-core host; a run with cached images needs a fraction of it."""
REQUESTED = os.environ.get("PDSERVE_CONTAINER_TESTS") == "1"
SERVED = "tiny-llama"

# The module fixture's up (a build when cold) counts against the first test's timeout.
pytestmark = [pytest.mark.container, pytest.mark.timeout(UP_TIMEOUT_S + 900)]


def _podman(*args: str, check: bool = True) -> str:
    env = {**os.environ, "CONTAINERS_CONF": str(REPO / "deploy" / "containers.podman.conf")}
    result = subprocess.run(
        ["podman", *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: {result.stderr}")
    return result.stdout


def _install_podman() -> str | None:
    """None when podman is there (with what a cold build needs, installed now if asked and
    possible), else why not."""
    missing = [tool for tool in ("podman", "runc", "mmdebstrap") if shutil.which(tool) is None]
    if not missing or (not REQUESTED and "podman" not in missing):
        return None  # without mmdebstrap, cached base images still serve
    if not REQUESTED:
        return "podman is not installed (make test-container installs it as root)"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"{', '.join(missing)} not installed and apt-get as root is not available"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", *missing]):
        result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            return f"could not install {', '.join(missing)}: {result.stderr[-500:]}"
    return None


def _skip_reason() -> str | None:
    why = _install_podman()
    if why is not None:
        return why
    if REQUESTED:
        return None
    missing = [
        image
        for image in IMAGES
        if subprocess.run(["podman", "image", "exists", image], check=False).returncode != 0
    ]
    if missing:
        return (f"images not built yet ({', '.join(missing)}): a cold build takes minutes; "
                "make test-container (PDSERVE_CONTAINER_TESTS=1) builds them")  # fmt: skip
    return None


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, int]]:
    why = _skip_reason()
    if why is not None:
        pytest.skip(why)
    models = tmp_path_factory.mktemp("models")
    subprocess.run(
        [sys.executable, "-m", "services.models.tiny", str(models / SERVED), "--arch", "llama",
         "--size", "tiny"],
        check=True, cwd=REPO, capture_output=True,
    )  # fmt: skip
    # The gateway runs as an unprivileged user: the model must be readable by anyone.
    subprocess.run(["chmod", "-R", "a+rX", str(models)], check=True)
    prefill, decode, gateway_http, gateway_grpc, envoy_http, envoy_grpc, admin = free_ports(7)
    decode_base = free_ports(2, consecutive=True)[0]
    ports = {"envoy_http": envoy_http, "envoy_grpc": envoy_grpc}
    del decode
    topology = {
        "model": f"/models/{SERVED}",
        "dtype": "float32",
        "kv_transport": "shm",
        "prefill": {"count": 1, "base_grpc_port": prefill},
        "decode": {"count": 2, "base_grpc_port": decode_base},
        "gateway": {"http_port": gateway_http, "grpc_port": gateway_grpc, "replicas": 1},
        "envoy": {"http_port": envoy_http, "grpc_port": envoy_grpc, "admin_port": admin},
    }
    topology_file = tmp_path_factory.mktemp("topology") / "topology.yaml"
    topology_file.write_text(yaml.safe_dump(topology))
    engine = [sys.executable, "-m", "deploy.engine"]
    args = ["--engine", "podman", "--cpu", "--topology", str(topology_file), "--project", PROJECT]
    env = {**os.environ, "PDSERVE_MODELS_DIR": str(models)}
    networks, volumes = _podman("network", "ls", "-q"), _podman("volume", "ls", "-q")
    try:
        up = subprocess.run([*engine, "up", *args], cwd=REPO, env=env, timeout=UP_TIMEOUT_S,
                            capture_output=True, text=True, check=False)  # fmt: skip
        assert up.returncode == 0, f"up failed:\n{up.stdout[-4000:]}\n{up.stderr[-8000:]}"
        yield ports
    finally:
        down = subprocess.run([*engine, "down", *args], cwd=REPO, env=env, timeout=300,
                              capture_output=True, text=True, check=False)  # fmt: skip
        assert down.returncode == 0, down.stderr
    left = _podman("ps", "--all", "--filter", f"label={LABEL}={PROJECT}", "--format", "{{.Names}}")
    assert left.split() == [], f"containers left after down: {left}"
    assert _podman("network", "ls", "-q") == networks
    assert _podman("volume", "ls", "-q") == volumes


def _chat(port: int, text: str, *, stream: bool) -> None:
    """One chat completion through Envoy; fails unless it finished normally."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                    timeout=120)  # fmt: skip
    messages = [{"role": "user", "content": text}]
    if not stream:
        reply = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=8)
        assert reply.choices[0].finish_reason in ("length", "stop")
        return
    chunks = list(client.chat.completions.create(
        model=SERVED, messages=messages, max_tokens=8, stream=True))  # fmt: skip
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [r for r in reasons if r] in (["length"], ["stop"])


def test_streamed_chat_completion_through_envoy(deployment: dict[str, int]) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{deployment['envoy_http']}/v1", api_key="unused",
                    max_retries=0, timeout=120)  # fmt: skip
    stream = client.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, stream=True
    )
    chunks = list(stream)
    finished = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finished) == 1 and finished[0].choices[0].finish_reason in ("length", "stop")
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) >= 2, "a stream of one chunk streamed nothing"
    assert client.models.list().data[0].id == SERVED


def test_grpc_through_envoy(deployment: dict[str, int]) -> None:
    from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{deployment['envoy_grpc']}") as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        models = stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=60)
        assert [m.id for m in models.models] == [SERVED]
        request = gateway_pb2.GatewayGenerateRequest(
            text="Hello", sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True)
        )
        responses = list(stub.Generate(request, timeout=120))
    assert responses[-1].HasField("finished")
    assert responses[-1].finished.error == ""
    token_ids = [i for r in responses if r.HasField("delta") for i in r.delta.token_ids]
    assert len(token_ids) == 4


def _state(name: str) -> dict[str, object]:
    state: dict[str, object] = json.loads(_podman("inspect", "--format", "{{json .State}}", name))
    return state


def test_a_killed_decode_container_is_restarted_and_requests_still_succeed(
    deployment: dict[str, int],
) -> None:
    name = f"{PROJECT}-decode-0"
    before = _state(name)
    pid = before["Pid"]
    assert isinstance(pid, int) and pid > 0
    os.kill(pid, signal.SIGKILL)  # a crash, not a stop: the restart policy applies
    for i in range(4):  # the gateway retries on decode-1 while decode-0 is down
        _chat(deployment["envoy_http"], f"request {i}", stream=i % 2 == 0)
    deadline = time.monotonic() + 600  # reloading the model on a loaded host
    restarted = False
    while time.monotonic() < deadline and not restarted:
        state = _state(name)
        restarted = state["Status"] == "running" and state["Pid"] not in (0, pid)
        if not restarted:
            time.sleep(2)
    assert restarted, f"{name} was not restarted: {_state(name)}"
    deadline = time.monotonic() + 600
    while subprocess.run(["podman", "healthcheck", "run", name], capture_output=True,
                         check=False).returncode != 0:  # fmt: skip
        assert time.monotonic() < deadline, f"{name} restarted but never healthy again"
        time.sleep(2)
    _chat(deployment["envoy_http"], "after the restart", stream=True)

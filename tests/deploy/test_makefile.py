"""``make run`` / ``make up`` / ``make down`` pass their variables on (checked with ``make -n``,
which prints the commands without running them)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = "models/SmolLM2-135M-Instruct"
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")


def dry_run(*args: str) -> list[str]:
    # Under `make test` this is a sub-make: without --no-print-directory (and the parent's
    # MAKEFLAGS/MAKELEVEL) it adds "Entering/Leaving directory" lines around the commands.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    result = subprocess.run(
        ["make", "--no-print-directory", "-n", *args],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=True, env=env,
    )  # fmt: skip
    return result.stdout.splitlines()


def test_run_passes_every_variable_to_the_launcher() -> None:
    lines = dry_run("run", "MODEL=/m/qwen", "DTYPE=float32", "PREFILL=2", "DECODE=3",
                    "COLOCATED=1", "HOST=0.0.0.0", "HTTP_PORT=9000", "GRPC_PORT=9051",
                    "PREFILL_PORT=60061", "DECODE_PORT=60071", "COLOCATED_PORT=60081",
                    "PREFILL_METRICS_PORT=9101", "DECODE_METRICS_PORT=9111",
                    "COLOCATED_METRICS_PORT=9121",
                    "TOPOLOGY=deploy/topology.example.yaml")  # fmt: skip
    (launch,) = [line for line in lines if "-m deploy.launch" in line]
    assert shlex.split(launch)[3:] == [
        "--topology", "deploy/topology.example.yaml", "--model", "/m/qwen",
        "--dtype", "float32", "--prefill", "2", "--decode", "3", "--colocated", "1",
        "--host", "0.0.0.0", "--http-port", "9000", "--grpc-port", "9051",
        "--prefill-port", "60061", "--decode-port", "60071", "--colocated-port", "60081",
        "--prefill-metrics-port", "9101", "--decode-metrics-port", "9111",
        "--colocated-metrics-port", "9121",
    ]  # fmt: skip
    # MODEL given: neither the tiny model nor SmolLM2 is built or fetched.
    assert not any("services.models.tiny" in line or "fetch_model" in line for line in lines)


def test_plain_run_serves_smollm2_fetched_when_missing(tmp_path: Path) -> None:
    assert dry_run("run")[-1].split()[1:] == ["-m", "deploy.launch", "--model", DEFAULT_MODEL]
    # Both models pointed at a directory that is certainly empty (the checkout's models/ may
    # hold them already): the plain run fetches SmolLM2 and builds the tiny model first.
    smollm2, tiny = tmp_path / "SmolLM2-135M-Instruct", tmp_path / "tiny-llama"
    lines = dry_run("run", f"DEFAULT_MODEL={smollm2}", f"MODEL_DIR={tiny}")
    fetch = next(
        i for i, line in enumerate(lines) if f"-m deploy.fetch_model --dest {smollm2}" in line
    )
    build = next(i for i, line in enumerate(lines) if f"-m services.models.tiny {tiny}.tmp" in line)
    assert lines[-1].split()[1:] == ["-m", "deploy.launch", "--model", str(smollm2)]
    assert max(fetch, build) < len(lines) - 1


def test_a_topology_without_model_keeps_its_own_model() -> None:
    launch = dry_run("run", "TOPOLOGY=deploy/topology.example.yaml")[-1]
    assert shlex.split(launch)[1:] == [
        "-m",
        "deploy.launch",
        "--topology",
        "deploy/topology.example.yaml",
    ]


def test_paths_with_spaces_or_quotes_reach_the_launcher_whole() -> None:
    model, topology = "/m/tiny  llama", "/t/it's a topology.yaml"
    launch = dry_run("run", f"MODEL={model}", f"TOPOLOGY={topology}")[-1]
    assert shlex.split(launch)[1:] == [
        "-m", "deploy.launch", "--topology", topology, "--model", model,
    ]  # fmt: skip


def test_up_and_down_go_through_the_engine_with_the_cpu_override_on_request() -> None:
    (up,) = [line for line in dry_run("up") if "deploy.engine" in line]
    assert up.endswith("-m deploy.engine up --engine auto")
    cpu_up = dry_run("up", "CPU=1", "TOPOLOGY=deploy/topology.yaml", "CONTAINER_ENGINE=podman")
    assert any("-m deploy.generate --topology deploy/topology.yaml" in line for line in cpu_up)
    assert cpu_up[-1].endswith(
        "-m deploy.engine up --engine podman --cpu --topology deploy/topology.yaml"
    )
    assert dry_run("down", "CPU=1")[-1].endswith("-m deploy.engine down --engine auto --cpu")


def test_the_engine_runs_docker_compose_with_the_cpu_override() -> None:
    from deploy.engine import docker_compose

    assert docker_compose(cpu=False)[2:] == ["-f", str(REPO / "deploy/docker-compose.yml")]
    assert docker_compose(cpu=True)[-2:] == ["-f", str(REPO / "deploy/docker-compose.cpu.yml")]


def test_test_runs_lint_import_contracts_and_mypy_before_the_suite() -> None:
    lines = dry_run("test")
    steps = ["ruff check .", "ruff format --check .", "lint-imports", "bin/mypy", "-m pytest"]
    found = [next((i for i, line in enumerate(lines) if step in line), -1) for step in steps]
    assert -1 not in found and found == sorted(found), lines

"""The launcher refuses a bad command line or topology before it starts anything: one line
naming the flag, key or file, exit 2, no traceback. No test here starts a process."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.launch import build_parser, main, topology_from_args
from deploy.local_ports import free_ports


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def free_colocated(model: Path) -> list[str]:
    """One colocated node on ports nothing listens on, so only the case under test refuses."""
    http, grpc, node = free_ports(3)
    return [
        "--model", str(model), "--prefill", "0", "--decode", "0", "--colocated", "1",
        "--http-port", str(http), "--grpc-port", str(grpc), "--colocated-port", str(node),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("host", "message"),
    [
        ("no.such.host.invalid", "host 'no.such.host.invalid' (--host, HOST=, topology host): "
                                 "cannot resolve it"),
        ("192.0.2.1", "host '192.0.2.1' (--host, HOST=, topology host) is not an address of "
                      "this machine"),
    ],
)  # fmt: skip
def test_a_host_that_cannot_be_bound_is_named(
    host: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in refusal([*free_colocated(tmp_path), "--host", host], capsys)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("prefill:\n  count: 1\n\t bad\n", "not valid YAML (line 3)"),
        ("model: 123\n", "model must be a string, got 123"),
        ("gateway: {http_port: 8000.5}\n", "gateway.http_port must be an integer, got 8000.5"),
        ("prefill: {count: two}\n", "prefill.count must be an integer, got 'two'"),
        ("model: a\nmodel: b\n", "duplicate key 'model' (line 2, first on line 1)"),
        ("gateway: {args: {http-port: 18500}}\n", "gateway.args may not set ['http-port']"),
    ],
)
def test_a_bad_topology_file_is_named_with_its_key(
    text: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(text)
    line = refusal(["--topology", str(path), "--model", str(tmp_path)], capsys)
    assert f"{path}: " in line and message in line


def test_a_tls_dir_that_is_a_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    argv = [*free_colocated(tmp_path), "--tls", "--tls-dir", str(afile)]
    assert f"--tls-dir {afile} is not a directory" in refusal(argv, capsys)


@pytest.mark.parametrize(
    ("flag", "value", "rule"),
    [
        ("--startup-timeout-s", "-5", "> 0, got -5"),
        ("--startup-timeout-s", "0", "> 0"),
        ("--startup-timeout-s", "nan", "> 0"),
        ("--grace-s", "-5", ">= 0, got -5"),
        ("--restart-window-s", "inf", "> 0, got inf"),
        ("--restart-backoff-s", "-1", ">= 0, got -1"),
        ("--restart-backoff-s", "nan", ">= 0"),
    ],
)
def test_timeouts_must_be_positive(
    flag: str, value: str, rule: str, capsys: pytest.CaptureFixture[str]
) -> None:
    message = f"argument {flag}: must be a finite number {rule}"
    assert message in refusal([flag, value], capsys)


def test_loopback_between_separate_node_processes_is_refused_naming_the_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = refusal(["--model", str(tmp_path), "--kv-transport", "loopback"], capsys)
    assert "--kv-transport" in line and "loopback works only inside one process" in line
    assert "use auto, shm, cuda_ipc or ucx" in line


@pytest.mark.parametrize(
    "flags",
    [["--http-port", "8080"], ["--grpc-port", "8081"], ["--grpc-port", "9901"],
     ["--prefill-metrics-port", "9901"]],
)  # fmt: skip
def test_envoys_ports_are_free_for_the_launcher(flags: list[str]) -> None:
    # make run starts no Envoy: its ports (8080, 8081, 9901) are not reserved.
    topology_from_args(build_parser().parse_args(flags))


def test_gateway_replicas_reserve_no_port_the_launcher_never_binds(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("gateway: {http_port: 8000, replicas: 3}\n")
    topology_from_args(build_parser().parse_args(["--topology", str(path), "--grpc-port", "8001"]))

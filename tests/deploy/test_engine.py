"""deploy.engine's choices that need no container engine: which engine, and what podman refuses.
tests/container runs up and down for real."""

from __future__ import annotations

import pytest

from deploy import engine


def test_auto_takes_docker_only_when_its_daemon_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(engine, "docker_daemon_answers", lambda: True)
    assert engine.choose_engine("auto") == "docker"
    monkeypatch.setattr(engine, "docker_daemon_answers", lambda: False)
    assert engine.choose_engine("auto") == "podman"  # a docker client without a daemon
    assert engine.choose_engine("docker") == "docker"  # named: taken as asked


def test_no_engine_at_all_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.shutil, "which", lambda name: None)
    monkeypatch.setattr(engine, "docker_daemon_answers", lambda: False)
    with pytest.raises(RuntimeError, match="podman is not installed"):
        engine.choose_engine("auto")
    with pytest.raises(ValueError, match="expected auto, docker or podman"):
        engine.choose_engine("containerd")


def test_podman_refuses_the_gpu_deployment(capsys: pytest.CaptureFixture[str]) -> None:
    assert engine.main(["up", "--engine", "podman"]) == 2
    assert "CPU=1" in capsys.readouterr().err

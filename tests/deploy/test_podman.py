"""deploy.podman (compose services → podman run), deploy.build_mounts (what a build carries in)
and the podman files deploy.generate writes. tests/container runs them for real."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deploy.build_mounts import BuildMounts, local_paths, merged_pip_config
from deploy.compose import compose_dict, cpu_override_dict
from deploy.generate import (
    CONTAINERS_CONF_FILE,
    DEFAULT_TOPOLOGY,
    DEPLOY_DIR,
    PODMAN_OVERRIDE_FILE,
    render_yaml,
)
from deploy.podman import Container, containers, containers_conf, merge, podman_override_dict
from deploy.topology import load_topology


def cpu_services() -> dict[str, Any]:
    topology = load_topology(DEFAULT_TOPOLOGY)
    merged = merge(compose_dict(topology), cpu_override_dict(topology))
    services: dict[str, Any] = merge(merged, podman_override_dict(topology))["services"]
    return services


def by_service(items: list[Container]) -> dict[str, Container]:
    return {c.service: c for c in items}


def flag_values(container: Container, flag: str) -> list[str]:
    args = container.run_args
    return [args[i + 1] for i, arg in enumerate(args) if arg == flag]


def test_the_committed_podman_files_are_what_the_topology_generates() -> None:
    topology = load_topology(DEFAULT_TOPOLOGY)
    expected = render_yaml(podman_override_dict(topology), source=DEFAULT_TOPOLOGY)
    assert PODMAN_OVERRIDE_FILE.read_text() == expected, "stale: run python -m deploy.generate"
    assert CONTAINERS_CONF_FILE.read_text() == containers_conf()


def test_containers_start_after_what_they_depend_on() -> None:
    items = containers(cpu_services(), project="p", base_dir=DEPLOY_DIR, env={})
    order = [c.service for c in items]
    assert order[0] == "kv-ipc"
    assert order.index("gateway") > max(order.index(n) for n in order if n.startswith("decode"))
    assert order[-1] == "envoy"
    assert set(by_service(items)["gateway"].waits_for) == {
        "prefill-0",
        "prefill-1",
        "decode-0",
        "decode-1",
    }
    assert by_service(items)["envoy"].waits_for == ("gateway",)
    assert by_service(items)["decode-0"].waits_for == ()


def test_nodes_share_the_ipc_holder_and_keep_no_memlock_limit() -> None:
    items = by_service(containers(cpu_services(), project="p", base_dir=DEPLOY_DIR, env={}))
    decode = items["decode-0"]
    assert flag_values(decode, "--ipc") == ["container:p-kv-ipc"]
    assert flag_values(items["kv-ipc"], "--ipc") == ["shareable"]
    assert flag_values(decode, "--ulimit") == []  # podman 4.3 rejects memlock -1
    assert flag_values(decode, "--network") == ["host"] and flag_values(decode, "--pid") == ["host"]
    assert flag_values(decode, "--restart") == ["unless-stopped"]
    assert flag_values(decode, "--name") == ["p-decode-0"]
    assert "PDSERVE_DEVICE=cpu" in flag_values(decode, "--env")
    assert flag_values(decode, "--env-file") == [str((DEPLOY_DIR / "env/decode.env").resolve())]
    assert decode.run_args[-4:] == ("pdserve-node-cpu", "python", "-m", "decode_node")
    health = flag_values(decode, "--health-cmd")
    assert health and health[0].startswith('["python", "-m", "deploy.probe", "grpc"')


def test_the_model_volume_expands_like_compose(tmp_path: Path) -> None:
    services = cpu_services()
    gateway = by_service(containers(services, project="p", base_dir=DEPLOY_DIR, env={}))["gateway"]
    default = (DEPLOY_DIR / "../models").resolve()
    assert flag_values(gateway, "--volume") == [f"{default}:/models:ro"]
    env = {"PDSERVE_MODELS_DIR": str(tmp_path)}
    gateway = by_service(containers(services, project="p", base_dir=DEPLOY_DIR, env=env))["gateway"]
    assert flag_values(gateway, "--volume") == [f"{tmp_path}:/models:ro"]


def test_a_compose_key_it_does_not_translate_is_refused() -> None:
    services = cpu_services()
    services["gateway"]["cap_add"] = ["NET_ADMIN"]
    with pytest.raises(ValueError, match="cap_add"):
        containers(services, project="p", base_dir=DEPLOY_DIR, env={})


def test_a_dependency_cycle_is_refused() -> None:
    services = cpu_services()
    services["kv-ipc"]["depends_on"] = {"envoy": {"condition": "service_started"}}
    with pytest.raises(ValueError, match="cycle"):
        containers(services, project="p", base_dir=DEPLOY_DIR, env={})


def test_the_pip_environment_wins_over_the_files_and_local_paths_are_mounted(
    tmp_path: Path,
) -> None:
    wheels, index = tmp_path / "wheels", tmp_path / "pypi"
    wheels.mkdir()
    (index / "simple").mkdir(parents=True)
    conf = tmp_path / "pip.conf"
    conf.write_text(
        f"[global]\nfind-links = /nonexistent\nextra-index-url = file://{index}/simple "
        "https://example.invalid/simple\ntimeout = 60\n"
    )
    options = merged_pip_config((conf,), {"PIP_FIND_LINKS": str(wheels), "HOME": "/x"})
    assert options["find-links"] == str(wheels) and options["timeout"] == "60"
    assert local_paths(options) == [wheels, index]
    mounts = BuildMounts(options=options, env={"HTTPS_PROXY": "http://proxy:3128"})
    try:
        args = mounts.build_args()
        written = mounts.pip_conf().read_text()
    finally:
        mounts.close()
    assert f"{wheels}:{wheels}:ro" in args and f"{index}:{index}:ro" in args
    assert "HTTPS_PROXY=http://proxy:3128" in args and "/nonexistent" not in " ".join(args)
    assert f"find-links = {wheels}" in written


def test_without_systemd_podman_schedules_no_healthcheck() -> None:
    """podman 4.3 schedules healthchecks with systemd timers; up polls them itself."""
    services = cpu_services()
    timed = by_service(containers(services, project="p", base_dir=DEPLOY_DIR, env={}))
    untimed = by_service(
        containers(services, project="p", base_dir=DEPLOY_DIR, env={}, health_timers=False)
    )
    assert flag_values(timed["gateway"], "--health-interval") == ["10s"]
    assert flag_values(untimed["gateway"], "--health-interval") == ["disable"]

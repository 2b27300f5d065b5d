"""``auto`` as a dtype end to end through the configuration: ``make run DTYPE=auto`` to the
launcher, the topology, each node's command line and its engine config; the node default; and
the metric a node exports of its choice."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from deploy.commands import local_processes
from deploy.launch import build_parser, topology_from_args
from deploy.topology import Topology, topology_from_dict
from services.node.config import parse_node_config
from services.node.metrics import NodeMetrics
from services.types import Role

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
@pytest.mark.parametrize(
    ("make_var", "flag", "expected"),
    [
        ("DTYPE=auto", "--dtype", {"dtype": "auto"}),
        (
            "KV_CACHE_DTYPE=float32",
            "--kv-cache-dtype",
            {"kv_cache_dtype": "float32", "dtype": "auto"},
        ),
    ],
)
def test_make_run_reaches_every_nodes_engine_config(
    make_var: str, flag: str, expected: dict[str, str]
) -> None:
    """``make run DTYPE=`` / ``KV_CACHE_DTYPE=``: the launcher's flag, its topology and the
    engine config of both nodes it would start."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    result = subprocess.run(
        ["make", "--no-print-directory", "-n", "run", "MODEL=/m/x", make_var],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=True, env=env,
    )  # fmt: skip
    (launch,) = [line for line in result.stdout.splitlines() if "-m deploy.launch" in line]
    launcher_argv = launch.split()[3:]
    assert launcher_argv[launcher_argv.index(flag) + 1] == make_var.split("=")[1]
    topology = topology_from_args(build_parser().parse_args(launcher_argv))
    assert {field: getattr(topology, field) for field in expected} == expected
    nodes = [p for p in local_processes(topology, python="py") if "_node" in p.argv[2]]
    assert len(nodes) == 2
    for process in nodes:
        role = Role.PREFILL if process.argv[2] == "prefill_node" else Role.DECODE
        config = parse_node_config(list(process.argv[3:]), {}, role=role)
        assert {field: getattr(config.engine, field) for field in expected} == expected


def test_auto_is_the_node_and_topology_default_and_an_explicit_dtype_wins() -> None:
    assert parse_node_config([], {}, role=Role.DECODE).engine.dtype == "auto"
    assert Topology().dtype == "auto"
    assert topology_from_dict({"dtype": "auto"}).dtype == "auto"
    env = {"PDSERVE_DTYPE": "auto"}
    assert parse_node_config([], env, role=Role.PREFILL).engine.dtype == "auto"
    explicit = parse_node_config(["--dtype", "float32"], env, role=Role.PREFILL)
    assert explicit.engine.dtype == "float32"


def test_a_node_exports_its_dtype_choice_and_the_measured_rates() -> None:
    metrics = NodeMetrics("decode", "d0")
    metrics.compute_dtype("float32", "measured", {"bfloat16": 160.0, "float32": 300.0})
    labels = {"role": "decode", "node": "d0"}
    sample = metrics.registry.get_sample_value
    assert sample("pdserve:gemm_gflops", {**labels, "dtype": "float32"}) == 300.0
    assert sample("pdserve:gemm_gflops", {**labels, "dtype": "bfloat16"}) == 160.0
    info = {**labels, "dtype": "float32", "source": "measured"}
    assert sample("pdserve:compute_dtype_info", info) == 1.0
    assert sample("pdserve:compute_dtype_info", {**info, "dtype": "bfloat16"}) is None


def test_kv_cache_dtype_defaults_to_auto_and_a_bad_one_is_refused_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert parse_node_config([], {}, role=Role.DECODE).engine.kv_cache_dtype == "auto"
    assert Topology().kv_cache_dtype == "auto"
    env = {"PDSERVE_KV_CACHE_DTYPE": "bfloat16"}
    assert parse_node_config([], env, role=Role.PREFILL).engine.kv_cache_dtype == "bfloat16"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        topology_from_dict({"kv_cache_dtype": "fp8"})
    with pytest.raises(SystemExit) as exit_info:
        parse_node_config(["--kv-cache-dtype", "fp8"], {}, role=Role.DECODE)
    assert exit_info.value.code == 2 and "--kv-cache-dtype" in capsys.readouterr().err
    # float16 is GPU only: the engine config's error, reported by the parser.
    with pytest.raises(SystemExit):
        parse_node_config(["--kv-cache-dtype", "float16"], {}, role=Role.DECODE)
    assert "--kv-cache-dtype float16 is supported on GPU only" in capsys.readouterr().err


def test_a_node_exports_its_kv_cache_dtype() -> None:
    metrics = NodeMetrics("prefill", "p0")
    metrics.kv_cache_dtype("bfloat16", "cpu default")
    info = {"role": "prefill", "node": "p0", "dtype": "bfloat16", "source": "cpu default"}
    sample = metrics.registry.get_sample_value
    assert sample("pdserve:kv_cache_dtype_info", info) == 1.0
    assert sample("pdserve:kv_cache_dtype_info", {**info, "dtype": "float32"}) is None


def test_a_topologys_quantization_args_reach_each_nodes_engine_config() -> None:
    """The README's ``args: {quantization: fp8}``: both roles' engines get fp8 projections."""
    topology = topology_from_dict(
        {
            "model": "/m/x",
            "prefill": {"args": {"quantization": "fp8"}},
            "decode": {"args": {"quantization": "fp8"}},
        }
    )
    nodes = [p for p in local_processes(topology, python="py") if "_node" in p.argv[2]]
    assert len(nodes) == 2
    for process in nodes:
        role = Role.PREFILL if process.argv[2] == "prefill_node" else Role.DECODE
        config = parse_node_config(list(process.argv[3:]), {}, role=role)
        assert config.engine.quantization == "fp8"

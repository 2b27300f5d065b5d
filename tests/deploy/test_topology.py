"""The topology: YAML loading, validation that names the bad key, derived node instances, and
the processes the launcher builds from it."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest

from deploy.commands import local_processes
from deploy.topology import Role, Topology, load_topology, topology_from_dict
from services.node.config import parse_node_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_default_is_one_prefill_and_one_decode_on_the_default_ports() -> None:
    topology = Topology()
    assert [(n.name, n.grpc_port) for n in topology.nodes] == [
        ("prefill-0", 50061),
        ("decode-0", 50071),
    ]
    assert topology.model_name == "tiny-llama"


def test_counts_ports_and_gpus_are_derived_per_node() -> None:
    topology = topology_from_dict(
        {
            "model": "/models/Qwen2.5-0.5B-Instruct",
            "prefill": {"count": 2, "gpu_ids": [0, 1], "base_metrics_port": 9101},
            "decode": {"count": 2, "gpu_ids": [2, 3], "base_grpc_port": 52000},
            "colocated": {"count": 1},
        }
    )
    assert [(n.name, n.grpc_port, n.metrics_port, n.gpu_id) for n in topology.nodes] == [
        ("prefill-0", 50061, 9101, 0),
        ("prefill-1", 50062, 9102, 1),
        ("decode-0", 52000, None, 2),
        ("decode-1", 52001, None, 3),
        ("colocated-0", 50081, None, None),
    ]
    assert topology.model_name == "Qwen2.5-0.5B-Instruct"


def test_the_example_files_load() -> None:
    example = load_topology(DEPLOY / "topology.example.yaml")
    assert example.prefill.args == (("kv-cache-memory", "256MiB"),
                                    ("max-num-batched-tokens", "2048"))  # fmt: skip
    assert example.prefill.env == (("OMP_NUM_THREADS", "2"),)
    compose = load_topology(DEPLOY / "topology.yaml")
    assert all(n.gpu_id is not None for n in compose.nodes)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"prefil": {"count": 1}}, "unknown key"),
        ({"decode": {"count": 1, "gpus": [0]}}, "unknown key"),
        ({"prefill": {"count": 2}, "decode": {"count": 0}}, "come in pairs"),
        ({"prefill": {"count": 0}, "decode": {"count": 0}}, "no nodes"),
        ({"prefill": {"count": 2, "gpu_ids": [0]}}, "one per node"),
        (
            {"prefill": {"gpu_ids": [0]}, "decode": {"gpu_ids": [0]}},
            r"GPU 0 is pinned to \['prefill-0', 'decode-0'\]: .* \(\['prefill-0', 'decode-0'\]",
        ),
        (
            {
                "prefill": {"gpu_ids": [0], "args": {"kv-cache-memory": "4GiB"}},
                "decode": {"gpu_ids": [0]},
            },
            r"must each set args.kv-cache-memory \(\['decode-0'\] do not\)",
        ),
        ({"prefill": {"count": 11}}, "port 50071 is used by both"),
        ({"decode": {"count": 2, "base_metrics_port": 65535}}, "decode.last metrics port"),
        ({"gateway": {"http_port": 50061}}, "port 50061"),
        ({"dtype": "fp8"}, "dtype"),
        ({"dtype": "fp8_e5m2"}, "dtype must be one of"),  # a KV cache dtype only
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype must be one of"),
        (
            {"kv_cache_dtype": "fp8_e5m2", "decode": {"gpu_ids": [0]}},
            "fp8_e5m2 is supported on CPU nodes only",
        ),
        ({"kv_transport": "tcp"}, "kv_transport"),
        ({"decode": {"args": {"grpc-port": 1}}}, "may not set"),
        ({"decode": {"args": {"--max-num-seqs": 1}}}, "not a flag name"),
        ({"gateway": {"replicas": 0}}, "replicas"),
        ({"model": ["a"]}, "single value"),
        # Every field is type-checked, naming its key; bool is no integer.
        ({"prefill": {"count": "two"}}, r"prefill.count must be an integer, got 'two'"),
        ({"prefill": {"count": 1.5}}, r"prefill.count must be an integer, got 1.5"),
        ({"prefill": {"count": True}}, r"prefill.count must be an integer, got True"),
        ({"prefill": {"base_grpc_port": "50061"}}, r"prefill.base_grpc_port must be an integer"),
        ({"decode": {"base_metrics_port": 9.5}}, r"decode.base_metrics_port must be an integer"),
        ({"decode": {"gpu_ids": [True]}}, r"decode.gpu_ids\[\] must be an integer"),
        ({"gateway": {"http_port": 8000.5}}, r"gateway.http_port must be an integer, got 8000.5"),
        ({"gateway": {"replicas": "2"}}, r"gateway.replicas must be an integer"),
        ({"envoy": {"max_requests": 1.5}}, r"envoy.max_requests must be an integer"),
        ({"envoy": {"stream_idle_timeout_s": "5"}}, r"envoy.stream_idle_timeout_s must be a num"),
        ({"envoy": {"stream_idle_timeout_s": float("nan")}}, r"stream_idle_timeout_s must be >"),
        ({"kubernetes": {"gateway_queue_target": True}}, r"kubernetes.gateway_queue_target"),
        ({"kubernetes": {"namespace": 5}}, r"kubernetes.namespace must be a string"),
        ({"model": 123}, r"model must be a string, got 123"),
        ({"host": 127}, r"host must be a string"),
        ({"served_model_name": 5}, r"served_model_name must be a string"),
        ({"tls": "yes"}, r"tls must be true or false"),
        ({"lora_modules": ["sql"]}, r"lora_modules must be a mapping"),
        ({"lora_modules": {"a,b": "/p"}}, r"names must be non-empty strings without"),
        ({"lora_modules": {"sql": ""}}, r"lora_modules.sql must be a path"),
        ({"decode": {"args": {"lora-modules": "a=/p"}}}, r"may not set \['lora-modules'\]"),
        # The flags the topology derives (and the launcher health-checks) are not overridable.
        ({"gateway": {"args": {"http-port": 18500}}}, r"gateway.args may not set \['http-port'\]"),
        ({"gateway": {"args": {"host": "0.0.0.0"}}}, r"gateway.args may not set \['host'\]"),
        ({"gateway": {"args": {"colocated": "h:1"}}}, r"may not set \['colocated'\]"),
        ({"gateway": {"args": {"served-model-name": "x"}}}, r"may not set"),
        ({"gateway": {"args": {"http-p": 18500}}}, r"may not set \['http-p'\]"),  # argparse prefix
        ({"prefill": {"args": {"dtype": "float32"}}}, r"prefill.args may not set \['dtype'\]"),
        ({"decode": {"args": {"model": "m"}}}, r"decode.args may not set \['model'\]"),
        ({"colocated": {"count": 1, "args": {"device": "cuda"}}}, r"may not set \['device'\]"),
        ({"decode": {"args": {"host": "0.0.0.0"}}}, r"may not set \['host'\]"),
        ({"decode": {"args": {"tls-cert": "c"}}}, r"may not set \['tls-cert'\]"),
        ({"decode": {"args": {"seed": [1]}}}, r"decode.args.seed must be a single value"),
        # Two processes cannot share a loopback transport.
        ({"kv_transport": "loopback"}, r"loopback works only inside one process.*use auto"),
        # env values: a string or an integer, never str(None) / str(True).
        ({"prefill": {"env": {"UCX_TLS": None}}}, r"prefill.env.UCX_TLS must be a string"),
        ({"gateway": {"env": {"X": True}}}, r"gateway.env.X must be a string .*, got True"),
        ({"decode": {"env": {"X": 1.5}}}, r"decode.env.X must be a string"),
    ],
)
def test_bad_topologies_name_what_is_wrong(raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        topology_from_dict(raw)


def test_env_integers_are_passed_as_written_and_loopback_serves_colocated_nodes() -> None:
    topology = topology_from_dict(
        {
            "kv_transport": "loopback",
            "prefill": {"count": 0},
            "decode": {"count": 0},
            "colocated": {"count": 1, "env": {"OMP_NUM_THREADS": 2, "UCX_TLS": ""}},
        }
    )
    assert local_processes(topology, python="py")[0].env == (
        ("OMP_NUM_THREADS", "2"),
        ("UCX_TLS", ""),
    )


def test_the_launcher_reserves_only_the_ports_it_binds_and_compose_checks_the_rest() -> None:
    from deploy.compose import compose_dict

    # Envoy's ports and replica 1's are not the launcher's: 8080, 9901 and 8001 are free for it.
    for raw in (
        {"gateway": {"http_port": 8080, "grpc_port": 9901}},
        {"gateway": {"replicas": 2}, "decode": {"base_grpc_port": 8001}},
        {"prefill": {"base_metrics_port": 8081}},
    ):
        topology = topology_from_dict(raw)
        with pytest.raises(ValueError, match="is used by both"):
            compose_dict(topology)
    compose_dict(topology_from_dict({"gateway": {"replicas": 2}}))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model: models/tiny-llama\nmodel: models/small-llama\n",
         "duplicate key 'model' (line 2, first on line 1)"),
        ("prefill:\n  count: 1\n  count: 2\n", "duplicate key 'count' (line 3, first on line 2)"),
        ("prefill:\n  count: 1\n\t bad\n", "not valid YAML (line 3)"),
        ("model: 123\n", "model must be a string, got 123"),
    ],
)  # fmt: skip
def test_a_bad_file_names_itself_the_key_and_the_line(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as refused:
        load_topology(path)
    assert str(refused.value).startswith(f"{path}: {message}")


def test_yaml_merge_keys_may_still_override() -> None:
    from services.yaml_load import load_yaml

    text = "base: &b {count: 1, base_grpc_port: 50061}\nprefill:\n  <<: *b\n  count: 2\n"
    assert load_yaml(text)["prefill"] == {"count": 2, "base_grpc_port": 50061}


def test_nodes_with_their_own_cache_size_share_a_gpu() -> None:
    topology = topology_from_dict(
        {
            "prefill": {"gpu_ids": [0], "args": {"kv-cache-memory": "4GiB"}},
            "decode": {"count": 2, "gpu_ids": [0, 1], "args": {"kv-cache-memory": "8GiB"}},
        }
    )
    assert [n.gpu_id for n in topology.nodes] == [0, 0, 1]


def test_a_bad_file_names_itself(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("decode: {count: -1}\n")
    with pytest.raises(ValueError, match=f"{path}: decode.count"):
        load_topology(path)


def test_with_counts_drops_gpu_pins_only_where_the_count_changes() -> None:
    topology = topology_from_dict({"prefill": {"gpu_ids": [0]}, "decode": {"gpu_ids": [1]}})
    scaled = topology.with_counts(prefill=2, decode=1)
    assert scaled.prefill.count == 2 and scaled.prefill.gpu_ids == ()
    assert scaled.decode.gpu_ids == (1,)


def test_local_processes_pass_the_topology_as_flags() -> None:
    topology = topology_from_dict(
        {
            "model": "/m/qwen",
            "dtype": "float32",
            "prefill": {"gpu_ids": [3], "args": {"no-prefix-caching": True, "seed": 7}},
            "colocated": {"count": 1},
            "gateway": {"http_port": 9000, "args": {"max-retries": 1}},
        }
    )
    prefill, decode, colocated, gateway = local_processes(topology, python="py")
    assert prefill.argv[:3] == ("py", "-m", "prefill_node")
    argv = " ".join(prefill.argv)
    assert "--device cuda:3" in argv and "--kv-transport auto" in argv
    assert "--grpc-port 50061" in argv and "--node-id prefill-0" in argv
    assert argv.endswith("--no-prefix-caching --seed 7")
    assert "--device cpu" in " ".join(decode.argv)
    assert colocated.argv[2:5] == ("decode_node", "--role", "colocated")
    gateway_argv = " ".join(gateway.argv)
    assert "--prefill 127.0.0.1:50061 --decode 127.0.0.1:50071" in gateway_argv
    assert "--colocated 127.0.0.1:50081" in gateway_argv
    assert "--served-model-name qwen" in gateway_argv and gateway_argv.endswith("--max-retries 1")
    assert [str(t) for t in gateway.health] == [
        "http http://127.0.0.1:9000/health",
        "grpc 127.0.0.1:50051",
    ]


def test_lora_modules_reach_every_node_and_the_gateway_as_their_flags_parse_them(
    tiny_llama_dir: Path,
) -> None:
    from deploy.compose import compose_dict
    from deploy.kubernetes import gateway_config, node_config
    from gateway.config import parse_gateway_config
    from services.node.config import parse_node_config

    topology = topology_from_dict(
        {
            "model": str(tiny_llama_dir),
            "lora_modules": {"sql": "/a/sql", "chat": "/a/chat"},
            "colocated": {"count": 1},
        }
    )
    modules = (("sql", Path("/a/sql")), ("chat", Path("/a/chat")))
    *nodes, gateway = local_processes(topology, python="py")
    for node in nodes:
        config = parse_node_config(list(node.argv[3:]), {})
        assert config.engine.lora is not None and config.engine.lora.lora_modules == modules
        assert config.engine.lora.max_loras == 2
    assert parse_gateway_config(list(gateway.argv[3:]), {}).lora_modules == ("sql", "chat")
    # Compose and Kubernetes: the variable every flag falls back to, comma-separated.
    services = compose_dict(topology)["services"]
    node_env = services["prefill-0"]["environment"]
    assert node_env["PDSERVE_LORA_MODULES"] == "sql=/a/sql,chat=/a/chat"
    assert services["gateway"]["environment"]["PDSERVE_LORA_MODULES"] == "sql,chat"
    env = {"PDSERVE_LORA_MODULES": node_env["PDSERVE_LORA_MODULES"]}
    config = parse_node_config(["--role", "decode", "--model", str(tiny_llama_dir)], env)
    assert config.engine.lora is not None and config.engine.lora.lora_modules == modules
    assert (
        node_config(topology, topology.decode)["PDSERVE_LORA_MODULES"]
        == env["PDSERVE_LORA_MODULES"]
    )
    assert gateway_config(topology)["PDSERVE_LORA_MODULES"] == "sql,chat"
    assert (
        "PDSERVE_LORA_MODULES" not in compose_dict(Topology())["services"]["gateway"]["environment"]
    )


def test_a_server_bound_to_every_interface_is_reached_on_loopback() -> None:
    topology = Topology(host="0.0.0.0")
    *_, gateway = local_processes(topology, python="py")
    assert "--host 0.0.0.0" in " ".join(gateway.argv)
    assert "--decode 127.0.0.1:50071" in " ".join(gateway.argv)
    assert Role.DECODE.module == "decode_node"


def test_kv_transport_comes_from_the_topology_and_the_launcher_flag() -> None:
    from deploy.compose import node_service
    from deploy.launch import build_parser, topology_from_args

    shm = topology_from_args(build_parser().parse_args(["--kv-transport", "shm"]))
    prefill = local_processes(shm, python="py")[0]
    assert "--kv-transport shm" in " ".join(prefill.argv)
    node = shm.nodes[0]
    assert node_service(shm, shm.group(node.role), node)["pid"] == "host"  # /proc/<pid>/fd
    ucx = topology_from_dict({"kv_transport": "ucx"})
    node = ucx.nodes[0]
    assert "pid" not in node_service(ucx, ucx.group(node.role), node)


def test_metrics_port_flags_number_every_node_of_their_role(tmp_path: Path) -> None:
    from deploy.launch import build_parser, topology_from_args

    path = tmp_path / "t.yaml"
    path.write_text("prefill: {base_grpc_port: 52061, base_metrics_port: 9001}\n")
    args = build_parser().parse_args([
        "--topology", str(path), "--prefill", "2", "--decode", "2", "--colocated", "1",
        "--prefill-metrics-port", "9101", "--colocated-metrics-port", "9121",
    ])  # fmt: skip
    topology = topology_from_args(args)
    # The flag wins over the file's base_metrics_port and keeps its base_grpc_port.
    assert [(n.name, n.grpc_port, n.metrics_port) for n in topology.nodes] == [
        ("prefill-0", 52061, 9101),
        ("prefill-1", 52062, 9102),
        ("decode-0", 50071, None),
        ("decode-1", 50072, None),
        ("colocated-0", 50081, 9121),
    ]
    prefill_1 = local_processes(topology, python="py")[1]
    assert "--metrics-port 9102" in " ".join(prefill_1.argv)
    decode = build_parser().parse_args(["--decode-metrics-port", "9111"])
    assert topology_from_args(decode).decode.base_metrics_port == 9111


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prefill-metrics-port", "0"], "prefill.base_metrics_port must be in [1, 65535]"),
        (["--decode", "2", "--decode-metrics-port", "65535"], "decode.last metrics port"),
        (["--colocated", "1", "--colocated-metrics-port", "50071"], "port 50071 is used by both"),
        (["--decode-metrics-port", "x"], "argument --decode-metrics-port: invalid int value"),
    ],
)
def test_a_bad_metrics_port_flag_exits_2_naming_it(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from deploy.launch import main

    with pytest.raises(SystemExit) as exited:
        main(flags)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_taken_metrics_port_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from deploy.launch import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exited:
            main(["--model", str(tmp_path), "--no-gateway", "--decode-metrics-port", str(port)])
    assert exited.value.code == 2
    assert re.search(
        rf"port\(s\) \[[^]]*\b{port}\b[^]]*\] on 127.0.0.1 are in use", capsys.readouterr().err
    )


def test_a_json_flag_takes_a_mapping() -> None:
    """``args: {hf-overrides: {is_matryoshka: true}}``: the mapping goes as its JSON text, which
    the node's flag parses back (a list is still refused: no flag takes one)."""
    overrides = {"is_matryoshka": True, "rope_scaling": {"factor": 2.0}}
    topology = topology_from_dict(
        {
            "model": "/m/qwen",
            "prefill": {"args": {"hf-overrides": overrides}},
            "decode": {"args": {"hf-overrides": overrides}},
        }
    )
    prefill, decode, gateway = local_processes(topology, python="py")
    for process in (prefill, decode):
        index = process.argv.index("--hf-overrides")
        assert json.loads(process.argv[index + 1]) == overrides


def test_a_decode_nodes_speculative_config_reaches_its_engine() -> None:
    """``decode: {args: {speculative-config: {...}}}`` (README): the node parses it into the
    engine's ``SpeculativeConfig``."""
    speculative = {"num_speculative_tokens": 4, "prompt_lookup_max": 3}
    topology = topology_from_dict(
        {"model": "/m/qwen", "decode": {"args": {"speculative-config": speculative}}}
    )
    _, decode, _ = local_processes(topology, python="py")
    index = decode.argv.index("--speculative-config")
    flags = ["--speculative-config", decode.argv[index + 1]]
    config = parse_node_config(flags, {}, role=Role.DECODE).engine.speculative
    assert config is not None
    assert (config.num_speculative_tokens, config.prompt_lookup_max) == (4, 3)

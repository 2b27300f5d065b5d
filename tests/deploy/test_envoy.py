"""The generated Envoy config, checked against Envoy's own v3 API: it must parse into a
``Bootstrap`` message (unknown fields, bad enums, bad durations and unresolvable typed_config
types all fail), and the settings that make SSE and gRPC streams safe must be there."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

# Imported for their side effect: the typed_config "@type" URLs resolve to these messages.
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.extensions.access_loggers.stream.v3 import stream_pb2  # noqa: F401
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2 as hcm_pb2,
)
from envoy.extensions.resource_monitors.downstream_connections.v3 import (  # noqa: F401
    downstream_connections_pb2,
)
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2  # noqa: F401
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from google.protobuf import json_format

from deploy.envoy.__main__ import main as envoy_main
from deploy.envoy.config import HTTP_CLUSTER, envoy_bootstrap
from deploy.generate import DEFAULT_TOPOLOGY, ENVOY_FILE, render_yaml
from deploy.topology import Topology, load_topology, topology_from_dict

SAFE_RETRY_ON = {"connect-failure", "reset-before-request"}


def parse(config: dict) -> bootstrap_pb2.Bootstrap:
    return json_format.ParseDict(config, bootstrap_pb2.Bootstrap())


def managers(bootstrap: bootstrap_pb2.Bootstrap) -> dict[str, hcm_pb2.HttpConnectionManager]:
    found = {}
    for listener in bootstrap.static_resources.listeners:
        (chain,) = listener.filter_chains
        (network_filter,) = chain.filters
        manager = hcm_pb2.HttpConnectionManager()
        assert network_filter.typed_config.Unpack(manager)
        found[listener.name] = manager
    return found


@pytest.fixture(scope="module")
def bootstrap() -> bootstrap_pb2.Bootstrap:
    return parse(yaml.safe_load(ENVOY_FILE.read_text()))


def test_the_committed_file_is_what_the_topology_generates() -> None:
    expected = render_yaml(
        envoy_bootstrap(load_topology(DEFAULT_TOPOLOGY)), source=DEFAULT_TOPOLOGY
    )
    assert ENVOY_FILE.read_text() == expected, "run: python -m deploy.generate"


def test_admin_listens_on_localhost_only(bootstrap) -> None:
    address = bootstrap.admin.address.socket_address
    assert address.address == "127.0.0.1" and address.port_value == 9901


def test_listeners_serve_openai_http_and_grpc_on_the_topology_ports(bootstrap) -> None:
    ports = {
        listener.name: listener.address.socket_address.port_value
        for listener in bootstrap.static_resources.listeners
    }
    assert ports == {"openai_http": 8080, "public_grpc": 8081}
    by_name = managers(bootstrap)
    assert by_name["openai_http"].codec_type == hcm_pb2.HttpConnectionManager.AUTO
    assert by_name["public_grpc"].codec_type == hcm_pb2.HttpConnectionManager.HTTP2
    assert by_name["public_grpc"].http2_protocol_options.max_concurrent_streams.value == 1024


def test_streams_are_never_buffered_or_cut_by_a_timeout(bootstrap) -> None:
    for manager in managers(bootstrap).values():
        # Only the router: a buffer or compressor filter would hold SSE events back.
        assert [f.name for f in manager.http_filters] == ["envoy.filters.http.router"]
        assert manager.HasField("request_timeout") and manager.request_timeout.seconds == 0
        assert manager.stream_idle_timeout.seconds == 300
        assert manager.request_headers_timeout.seconds == 10
        assert manager.use_remote_address.value
        (host,) = manager.route_config.virtual_hosts
        for route in host.routes:
            if route.HasField("direct_response"):
                continue
            assert route.route.HasField("timeout") and route.route.timeout.seconds == 0
            assert route.route.idle_timeout.seconds == 300


def test_grpc_clients_deadlines_pass_through(bootstrap) -> None:
    (host,) = managers(bootstrap)["public_grpc"].route_config.virtual_hosts
    (route,) = host.routes
    assert route.match.HasField("grpc")
    duration = route.route.max_stream_duration
    assert (
        duration.HasField("grpc_timeout_header_max")
        and duration.grpc_timeout_header_max.seconds == 0
    )


def test_retries_only_where_no_byte_reached_the_gateway(bootstrap) -> None:
    for manager in managers(bootstrap).values():
        (host,) = manager.route_config.virtual_hosts
        for route in host.routes:
            if route.HasField("direct_response"):
                continue
            policy = route.route.retry_policy
            assert set(policy.retry_on.split(",")) == SAFE_RETRY_ON
            assert policy.num_retries.value == 2
            assert not policy.per_try_timeout.seconds  # a per-try timeout would cut streams
            assert [p.name for p in policy.retry_host_predicate] == [
                "envoy.retry_host_predicates.previous_hosts"
            ]


def test_metrics_are_not_exposed_at_the_edge(bootstrap) -> None:
    (host,) = managers(bootstrap)["openai_http"].route_config.virtual_hosts
    metrics = host.routes[0]
    assert metrics.match.prefix == "/metrics" and metrics.direct_response.status == 404


def test_access_logs_go_to_stdout_as_json(bootstrap) -> None:
    for manager in managers(bootstrap).values():
        (log,) = manager.access_log
        assert log.name == "envoy.access_loggers.stdout"
        logger = stream_pb2.StdoutAccessLog()
        assert log.typed_config.Unpack(logger)
        fields = logger.log_format.json_format.fields
        assert fields["status"].string_value == "%RESPONSE_CODE%"
        assert fields["grpc_status"].string_value == "%GRPC_STATUS%"
        assert fields["request_id"].string_value == "%REQ(X-REQUEST-ID)%"


def test_gateway_clusters_are_health_checked_ejected_and_bounded(bootstrap) -> None:
    clusters = {c.name: c for c in bootstrap.static_resources.clusters}
    assert set(clusters) == {"gateway_http", "gateway_grpc"}
    for name, cluster in clusters.items():
        (check,) = cluster.health_checks
        if name == "gateway_grpc":
            assert check.HasField("grpc_health_check")
        else:
            assert check.http_health_check.path == "/health"
        assert check.interval.seconds == 2 and check.unhealthy_threshold.value == 2
        outlier = cluster.outlier_detection
        assert outlier.consecutive_5xx.value == 5 and outlier.consecutive_gateway_failure.value == 3
        assert outlier.split_external_local_origin_errors
        assert 0 < outlier.max_ejection_percent.value < 100  # never eject every replica
        (threshold,) = cluster.circuit_breakers.thresholds
        assert threshold.max_requests.value == 1024 and threshold.max_retries.value > 0
        options = http_protocol_options_pb2.HttpProtocolOptions()
        typed = cluster.typed_extension_protocol_options[
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
        ]
        assert typed.Unpack(options)
        http2 = options.explicit_http_config.HasField("http2_protocol_options")
        assert http2 == (name == "gateway_grpc")  # gRPC upstream is HTTP/2; uvicorn is HTTP/1.1
        (locality,) = cluster.load_assignment.endpoints
        ports = [e.endpoint.address.socket_address.port_value for e in locality.lb_endpoints]
        assert ports == ([50051] if name == "gateway_grpc" else [8000])


def test_every_gateway_replica_is_an_endpoint() -> None:
    topology = topology_from_dict({"gateway": {"replicas": 3}, "envoy": {"max_requests": 64}})
    bootstrap = parse(envoy_bootstrap(topology, upstream_host="gateway.pdserve.svc"))
    cluster = next(c for c in bootstrap.static_resources.clusters if c.name == HTTP_CLUSTER)
    endpoints = [
        e.endpoint.address.socket_address for e in cluster.load_assignment.endpoints[0].lb_endpoints
    ]
    assert [(e.address, e.port_value) for e in endpoints] == [
        ("gateway.pdserve.svc", 8000),
        ("gateway.pdserve.svc", 8001),
        ("gateway.pdserve.svc", 8002),
    ]
    assert cluster.circuit_breakers.thresholds[0].max_requests.value == 64


def test_a_misspelt_field_would_be_caught() -> None:
    config = envoy_bootstrap(Topology())
    config["static_resources"]["clusters"][0]["outlier_detection"]["consecutive_5xxx"] = 5
    with pytest.raises(json_format.ParseError):
        parse(config)


def test_the_cli_writes_the_same_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "envoy.yaml"
    monkeypatch.setattr(sys, "argv", ["deploy.envoy", "--out", str(out)])
    envoy_main()
    assert out.read_text() == ENVOY_FILE.read_text()

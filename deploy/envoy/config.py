"""Envoy's v3 bootstrap for a topology: the edge in front of the gateway replicas.

- ``openai_http`` listener (HTTP/1.1 and h2c): the OpenAI API, including SSE streams. Nothing
  buffers a body (no buffer or compression filter: either would hold SSE events back), the
  route timeout is off (a generation streams as long as the gateway's own request timeout
  allows), and a stream idle timeout resets streams that move no byte.
- ``public_grpc`` listener (HTTP/2): ``pdserve.v1.GatewayService``; the client's
  ``grpc-timeout`` is the deadline (Envoy adds none).
- One cluster per protocol over the same gateway replicas: least-request balancing, active
  health checks (gRPC health on the gRPC cluster; ``GET /health`` on the HTTP cluster, which is
  200 only while the gateway has a healthy prefill+decode pair), outlier detection, circuit
  breakers.
- Retries only where no byte can have reached the gateway: ``connect-failure`` and
  ``reset-before-request``. A generation is not idempotent (sampling, cost), and once the
  gateway has the request its own retry policy (another prefill/decode pair) applies.
- JSON access logs on stdout; the admin interface on 127.0.0.1 only (it can drain listeners).
- With ``envoy.tls`` in the topology, both listeners terminate TLS with the certificate in
  ``EDGE_TLS_DIR`` (ALPN h2 and http/1.1 on the HTTP listener, h2 on the gRPC one); Envoy talks
  to the gateway replicas on the same host in plaintext.
"""

from __future__ import annotations

from typing import Any

from deploy.topology import Topology

_TYPES = "type.googleapis.com/envoy."
HCM_TYPE = _TYPES + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER_TYPE = _TYPES + "extensions.filters.http.router.v3.Router"
STDOUT_LOG_TYPE = _TYPES + "extensions.access_loggers.stream.v3.StdoutAccessLog"
HTTP_OPTIONS_TYPE = _TYPES + "extensions.upstreams.http.v3.HttpProtocolOptions"
PREVIOUS_HOSTS_TYPE = _TYPES + "extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
MAX_CONNECTIONS_TYPE = (
    _TYPES + "extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig"
)
TLS_SOCKET_TYPE = _TYPES + "extensions.transport_sockets.tls.v3.DownstreamTlsContext"
EDGE_TLS_DIR = "/etc/envoy/tls"
EDGE_CERT_NAME = "edge"
"""Compose mounts ``deploy/certs/edge.crt`` and ``edge.key`` at ``EDGE_TLS_DIR``."""
HTTP_CLUSTER = "gateway_http"
GRPC_CLUSTER = "gateway_grpc"
RETRY_ON = "connect-failure,reset-before-request"
MAX_DOWNSTREAM_CONNECTIONS = 50_000

ACCESS_LOG_FORMAT = {
    "start_time": "%START_TIME%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(X-ENVOY-ORIGINAL-PATH?:PATH)%",
    "protocol": "%PROTOCOL%",
    "status": "%RESPONSE_CODE%",
    "grpc_status": "%GRPC_STATUS%",
    "flags": "%RESPONSE_FLAGS%",
    "duration_ms": "%DURATION%",
    "upstream_headers_ms": "%RESPONSE_DURATION%",
    "bytes_received": "%BYTES_RECEIVED%",
    "bytes_sent": "%BYTES_SENT%",
    "upstream_host": "%UPSTREAM_HOST%",
    "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
    "client": "%DOWNSTREAM_REMOTE_ADDRESS%",
    "user_agent": "%REQ(USER-AGENT)%",
}


def seconds(value: float) -> str:
    """A protobuf Duration in its JSON form."""
    return f"{value:g}s"


def socket_address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def stdout_access_log() -> list[dict[str, Any]]:
    return [
        {
            "name": "envoy.access_loggers.stdout",
            "typed_config": {
                "@type": STDOUT_LOG_TYPE,
                "log_format": {"json_format": ACCESS_LOG_FORMAT},
            },
        }
    ]


def retry_policy() -> dict[str, Any]:
    return {
        "retry_on": RETRY_ON,
        "num_retries": 2,
        # A retry goes to another replica when there is one. The predicate only re-draws the
        # load balancer's pick, up to host_selection_retry_max_attempts times, and then takes
        # the previous host anyway: with two replicas and a random pick, 3 re-draws sent a retry
        # back to a dead replica about 1 time in 16 (a test saw a 503 while one was down); with 10,
        # about 1 in 2,048, and a second retry follows.
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": PREVIOUS_HOSTS_TYPE},
            }  # fmt: skip
        ],
        "host_selection_retry_max_attempts": 10,
    }


def http_connection_manager(
    topology: Topology, *, stat_prefix: str, grpc: bool, routes: list[dict[str, Any]]
) -> dict[str, Any]:
    envoy = topology.envoy
    manager: dict[str, Any] = {
        "@type": HCM_TYPE,
        "stat_prefix": stat_prefix,
        "codec_type": "HTTP2" if grpc else "AUTO",
        "use_remote_address": True,
        "generate_request_id": True,
        "normalize_path": True,
        "merge_slashes": True,
        # Streams: no overall limit (the route's is off too), but one that moves nothing for
        # stream_idle_timeout is reset; a client must send its headers promptly.
        "request_timeout": "0s",
        "stream_idle_timeout": seconds(envoy.stream_idle_timeout_s),
        "request_headers_timeout": "10s",
        "common_http_protocol_options": {
            "idle_timeout": "3600s",
            "headers_with_underscores_action": "REJECT_REQUEST",
        },
        "access_log": stdout_access_log(),
        "route_config": {
            "name": stat_prefix,
            "virtual_hosts": [{"name": "gateway", "domains": ["*"], "routes": routes}],
        },
        "http_filters": [
            {"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER_TYPE}}
        ],
    }
    if grpc:
        manager["http2_protocol_options"] = {
            "max_concurrent_streams": 1024,
            "initial_stream_window_size": 1 << 20,
            "initial_connection_window_size": 4 << 20,
            "connection_keepalive": {"interval": "30s", "timeout": "10s"},
        }
    return manager


def openai_routes(topology: Topology) -> list[dict[str, Any]]:
    return [
        # Metrics are for the operator's Prometheus, which scrapes the gateways directly.
        {"match": {"prefix": "/metrics"}, "direct_response": {"status": 404}},
        {
            "match": {"prefix": "/"},
            "route": {
                "cluster": HTTP_CLUSTER,
                "timeout": "0s",  # SSE: no end-to-end limit; stream_idle_timeout still applies
                "idle_timeout": seconds(topology.envoy.stream_idle_timeout_s),
                "retry_policy": retry_policy(),
            },
        },
    ]


def grpc_routes(topology: Topology) -> list[dict[str, Any]]:
    return [
        {
            "match": {"prefix": "/", "grpc": {}},
            "route": {
                "cluster": GRPC_CLUSTER,
                "timeout": "0s",
                "idle_timeout": seconds(topology.envoy.stream_idle_timeout_s),
                # The client's grpc-timeout header is the deadline, uncapped.
                "max_stream_duration": {"grpc_timeout_header_max": "0s"},
                "retry_policy": retry_policy(),
            },
        }
    ]


def downstream_tls(alpn: list[str]) -> dict[str, Any]:
    """TLS termination with the edge certificate."""
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": TLS_SOCKET_TYPE,
            "common_tls_context": {
                "tls_params": {"tls_minimum_protocol_version": "TLSv1_2"},
                "tls_certificates": [
                    {
                        "certificate_chain": {"filename": f"{EDGE_TLS_DIR}/{EDGE_CERT_NAME}.crt"},
                        "private_key": {"filename": f"{EDGE_TLS_DIR}/{EDGE_CERT_NAME}.key"},
                    }
                ],
                "alpn_protocols": alpn,
            },
        },
    }


def listener(
    name: str, port: int, manager: dict[str, Any], tls_alpn: list[str] | None = None
) -> dict[str, Any]:
    """``tls_alpn``: terminate TLS, offering these protocols; None: plaintext."""
    chain: dict[str, Any] = {
        "filters": [
            {"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}
        ]
    }
    if tls_alpn is not None:
        chain["transport_socket"] = downstream_tls(tls_alpn)
    return {
        "name": name,
        "address": socket_address("0.0.0.0", port),
        "per_connection_buffer_limit_bytes": 1 << 20,
        "filter_chains": [chain],
    }


def gateway_cluster(topology: Topology, *, grpc: bool, upstream_host: str) -> dict[str, Any]:
    gateway = topology.gateway
    base_port = gateway.grpc_port if grpc else gateway.http_port
    endpoints = [
        {"endpoint": {"address": socket_address(upstream_host, base_port + i)}}
        for i in range(gateway.replicas)
    ]
    health_check: dict[str, Any] = {
        "timeout": "1s",
        "interval": "2s",
        "interval_jitter": "0.5s",
        "unhealthy_threshold": 2,
        "healthy_threshold": 1,
        "no_traffic_interval": "5s",
    }
    if grpc:
        health_check["grpc_health_check"] = {"service_name": ""}
        protocol: dict[str, Any] = {"http2_protocol_options": {"max_concurrent_streams": 1024}}
    else:
        health_check["http_health_check"] = {"path": "/health"}
        protocol = {"http_protocol_options": {}}
    max_requests = topology.envoy.max_requests
    return {
        "name": GRPC_CLUSTER if grpc else HTTP_CLUSTER,
        "type": "STRICT_DNS",
        "dns_lookup_family": "V4_ONLY",
        "connect_timeout": "1s",
        "lb_policy": "LEAST_REQUEST",
        "load_assignment": {
            "cluster_name": GRPC_CLUSTER if grpc else HTTP_CLUSTER,
            "endpoints": [{"lb_endpoints": endpoints}],
        },
        "health_checks": [health_check],
        "outlier_detection": {
            "consecutive_5xx": 5,
            "consecutive_gateway_failure": 3,
            # Connect failures and resets count separately from the gateway's own 5xx.
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 3,
            "interval": "5s",
            "base_ejection_time": "15s",
            "max_ejection_percent": 50,
        },
        "circuit_breakers": {
            "thresholds": [
                {
                    "priority": "DEFAULT",
                    "max_connections": max_requests,
                    "max_pending_requests": max_requests,
                    "max_requests": max_requests,
                    "max_retries": 16,
                    "track_remaining": True,
                }
            ]
        },
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": HTTP_OPTIONS_TYPE,
                "common_http_protocol_options": {"idle_timeout": "300s"},
                "explicit_http_config": protocol,
            }
        },
    }


def envoy_bootstrap(topology: Topology, *, upstream_host: str = "127.0.0.1") -> dict[str, Any]:
    """``upstream_host``: where the gateway replicas are (127.0.0.1 on compose's host network;
    a DNS name such as a Kubernetes service resolves to every replica)."""
    envoy = topology.envoy
    http = http_connection_manager(
        topology, stat_prefix="openai_http", grpc=False, routes=openai_routes(topology)
    )
    grpc = http_connection_manager(
        topology, stat_prefix="public_grpc", grpc=True, routes=grpc_routes(topology)
    )
    return {
        "node": {"id": "pdserve-edge", "cluster": "pdserve"},
        "admin": {
            "address": socket_address("127.0.0.1", envoy.admin_port),
            "access_log": stdout_access_log(),
        },
        "static_resources": {
            "listeners": [
                listener(
                    "openai_http", envoy.http_port, http, ["h2", "http/1.1"] if envoy.tls else None
                ),
                listener("public_grpc", envoy.grpc_port, grpc, ["h2"] if envoy.tls else None),
            ],
            "clusters": [
                gateway_cluster(topology, grpc=False, upstream_host=upstream_host),
                gateway_cluster(topology, grpc=True, upstream_host=upstream_host),
            ],
        },
        "overload_manager": {
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": {
                        "@type": MAX_CONNECTIONS_TYPE,
                        "max_active_downstream_connections": MAX_DOWNSTREAM_CONNECTIONS,
                    },
                }
            ]
        },
    }

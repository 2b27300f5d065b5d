"""TLS in the deployment tooling: ``python -m deploy.certs``, the compose wiring of
``tls: true`` and Envoy's TLS listeners (parsed into Envoy's own v3 messages)."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.extensions.access_loggers.stream.v3 import stream_pb2  # noqa: F401
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
from envoy.extensions.filters.network.http_connection_manager.v3 import (  # noqa: F401
    http_connection_manager_pb2,
)
from envoy.extensions.resource_monitors.downstream_connections.v3 import (  # noqa: F401
    downstream_connections_pb2,
)
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2  # noqa: F401
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401
from google.protobuf import json_format

from deploy.certs import main as certs_main
from deploy.compose import compose_dict
from deploy.envoy.config import envoy_bootstrap
from deploy.topology import topology_from_dict

TOPOLOGY = {"prefill": {"count": 2}, "decode": {"count": 1}, "gateway": {"replicas": 2}}


def load_cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_certs_cover_every_service_with_local_and_extra_sans(tmp_path: Path) -> None:
    topology_file = tmp_path / "topology.yaml"
    topology_file.write_text("prefill: {count: 2}\ndecode: {count: 1}\ngateway: {replicas: 2}\n")
    out = tmp_path / "certs"
    assert certs_main(["--out", str(out), "--topology", str(topology_file),
                       "--san", "*.pdserve.svc"]) == 0  # fmt: skip
    names = ["prefill-0", "prefill-1", "decode-0", "gateway-0", "gateway-1"]
    ca = load_cert(out / "ca.crt")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for name in names:
        cert = load_cert(out / f"{name}.crt")
        cert.verify_directly_issued_by(ca)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert set(sans.get_values_for_type(x509.DNSName)) == {name, "localhost", "*.pdserve.svc"}
        assert ipaddress.ip_address("127.0.0.1") in sans.get_values_for_type(x509.IPAddress)
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usage)
        assert stat.S_IMODE((out / f"{name}.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((out / "ca.key").stat().st_mode) == 0o600

    # Run again for one more service: the CA is kept, so running services still trust it.
    assert certs_main(["--out", str(out), "--service", "edge"]) == 0
    assert load_cert(out / "ca.crt") == ca
    load_cert(out / "edge.crt").verify_directly_issued_by(ca)


def test_compose_with_tls_mounts_each_services_own_files_never_the_ca_key() -> None:
    services = compose_dict(topology_from_dict({**TOPOLOGY, "tls": True}))["services"]
    for name in ("prefill-0", "prefill-1", "decode-0", "gateway-0", "gateway-1"):
        service = services[name]
        volumes = service["volumes"]
        assert f"./certs/{name}.crt:/certs/tls.crt:ro" in volumes
        assert f"./certs/{name}.key:/certs/tls.key:ro" in volumes
        assert "./certs/ca.crt:/certs/ca.crt:ro" in volumes
        assert not any("ca.key" in v or v.startswith("./certs:") for v in volumes)
        env = service["environment"]
        assert (env["PDSERVE_TLS_CERT"], env["PDSERVE_TLS_KEY"], env["PDSERVE_TLS_CA"]) == (
            "/certs/tls.crt",
            "/certs/tls.key",
            "/certs/ca.crt",
        )
    plain = compose_dict(topology_from_dict(TOPOLOGY))["services"]
    assert not any("PDSERVE_TLS_CERT" in s.get("environment", {}) for s in plain.values())


def test_envoy_terminates_tls_on_both_listeners_when_asked() -> None:
    config = envoy_bootstrap(topology_from_dict({**TOPOLOGY, "envoy": {"tls": True}}))
    bootstrap = json_format.ParseDict(config, bootstrap_pb2.Bootstrap())
    alpn = {}
    for listener in bootstrap.static_resources.listeners:
        (chain,) = listener.filter_chains
        context = tls_pb2.DownstreamTlsContext()
        assert chain.transport_socket.typed_config.Unpack(context)
        (certificate,) = context.common_tls_context.tls_certificates
        assert certificate.certificate_chain.filename == "/etc/envoy/tls/edge.crt"
        assert certificate.private_key.filename == "/etc/envoy/tls/edge.key"
        alpn[listener.name] = list(context.common_tls_context.alpn_protocols)
    assert alpn == {"openai_http": ["h2", "http/1.1"], "public_grpc": ["h2"]}
    services = compose_dict(topology_from_dict({**TOPOLOGY, "envoy": {"tls": True}}))["services"]
    assert "./certs/edge.key:/etc/envoy/tls/edge.key:ro" in services["envoy"]["volumes"]

    plain = envoy_bootstrap(topology_from_dict(TOPOLOGY))
    for listener in plain["static_resources"]["listeners"]:
        assert "transport_socket" not in listener["filter_chains"][0]

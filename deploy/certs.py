"""``python -m deploy.certs --out DIR``: a deployment CA and one certificate per service, for
the mutual TLS between pdserve's processes (``services/tls.py``).

Writes into DIR: ``ca.crt`` and ``ca.key`` (the CA; the key stays with whoever issues
certificates, never in a container), and ``<service>.crt`` / ``<service>.key`` for each service
(``prefill-0``, ``decode-0``, ``gateway``, ... from ``--topology``; ``--service NAME`` adds one;
with neither, the default topology's). A CA
already in DIR is reused, so running it again with a new ``--service`` adds a certificate the
running services already trust.

Each service certificate is valid for both server and client authentication (a prefill node
serves the gateway and dials the decode node with the same certificate) and names, as SANs:
the service name, ``localhost``, ``127.0.0.1``, ``::1`` and every ``--san`` (for example the
Kubernetes DNS names ``decode-0.pdserve.svc.cluster.local`` or ``*.pdserve.svc``). Peers check
the SANs against the address they dial. Keys are ECDSA P-256, written with mode 0600.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from deploy.compose import gateway_name
from deploy.topology import Topology, load_topology

CA_NAME = "ca"
LOCAL_SANS = ("localhost", "127.0.0.1", "::1")
DEFAULT_CA_DAYS = 3650
DEFAULT_DAYS = 365


@dataclass(frozen=True)
class Issued:
    """A certificate and its private key, as written to ``<name>.crt`` / ``<name>.key``."""

    name: str
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def make_ca(common_name: str = "pdserve deployment CA", days: int = DEFAULT_CA_DAYS) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate small clock skew
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(CA_NAME, cert, key)


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def issue(ca: Issued, service: str, sans: Sequence[str] = (), days: int = DEFAULT_DAYS) -> Issued:
    """A certificate for ``service`` signed by ``ca``, for server and client authentication."""
    key = ec.generate_private_key(ec.SECP256R1())
    names = list(dict.fromkeys([service, *LOCAL_SANS, *sans]))  # ordered, without repeats
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, service)]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(min(now + datetime.timedelta(days=days), ca.cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([_san(n) for n in names]), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False
        )
        .sign(ca.key, hashes.SHA256())
    )
    return Issued(service, cert, key)


def write(issued: Issued, out_dir: Path) -> tuple[Path, Path]:
    """``<name>.crt`` (0644) and ``<name>.key`` (0600) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out_dir / f"{issued.name}.crt", out_dir / f"{issued.name}.key"
    cert_path.write_bytes(issued.cert.public_bytes(serialization.Encoding.PEM))
    key_pem = issued.key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    # Created 0600 before the key is written: never readable by others, not even briefly.
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(key_pem)
    os.chmod(key_path, 0o600)
    return cert_path, key_path


def load_ca(out_dir: Path) -> Issued | None:
    """The CA already in ``out_dir``, or None when there is none."""
    cert_path, key_path = out_dir / f"{CA_NAME}.crt", out_dir / f"{CA_NAME}.key"
    if not cert_path.exists() or not key_path.exists():
        return None
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{key_path}: not an ECDSA key written by deploy.certs")
    return Issued(CA_NAME, cert, key)


def service_names(topology: Topology) -> list[str]:
    """Every node of the topology and the gateway(s)."""
    gateways = [gateway_name(topology, i) for i in range(topology.gateway.replicas)]
    return [*(node.name for node in topology.nodes), *gateways]


def write_deployment(
    out_dir: Path, services: Sequence[str], sans: Sequence[str] = (), days: int = DEFAULT_DAYS
) -> Issued:
    """The CA (reused when ``out_dir`` has one) and a fresh certificate per service; returns
    the CA."""
    ca = load_ca(out_dir)
    if ca is None:
        ca = make_ca()
        write(ca, out_dir)
    for service in services:
        write(issue(ca, service, sans, days), out_dir)
    return ca


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.certs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--out", type=Path, required=True, help="directory for ca.* and <service>.*")
    add("--topology", type=Path, help="certificates for its nodes and gateway")
    add("--service", action="append", default=[], help="a service name (repeatable)")
    add("--san", action="append", default=[], help="extra DNS name or IP on every certificate")
    add("--days", type=int, default=DEFAULT_DAYS, help="validity of the service certificates")
    args = parser.parse_args(argv)
    services = list(args.service)
    if args.topology is not None or not services:
        try:
            topology = load_topology(args.topology) if args.topology else Topology()
        except (ValueError, OSError) as exc:
            parser.error(str(exc))
        services = [*service_names(topology), *services]
    for name in services:
        if not name or "/" in name or name.startswith(".") or name == CA_NAME:
            parser.error(f"--service: {name!r} is not a usable service name")
    if args.days < 1:
        parser.error(f"--days must be >= 1, got {args.days}")
    try:
        write_deployment(args.out, list(dict.fromkeys(services)), args.san, args.days)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote {args.out}/ca.crt and certificates for: {', '.join(services)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Mutual TLS between pdserve's own processes: one deployment CA signs a certificate for every
service (``python -m deploy.certs``); each process presents its own and trusts only that CA.

Every process that opens or serves an internal gRPC port (nodes, gateway, probes) takes the same
three flags, ``--tls-cert``, ``--tls-key`` and ``--tls-ca``, each falling back to
``PDSERVE_TLS_CERT`` / ``PDSERVE_TLS_KEY`` / ``PDSERVE_TLS_CA``. All three or none: none keeps
the plaintext ports of a development setup; all three make a node's server refuse any client
that does not present a certificate signed by the CA (``require_client_auth=True``), and make
every channel it opens verify the peer's certificate against the same CA and the target's host
name (so a certificate's SANs must name the address peers dial: the service name, or 127.0.0.1).

The files are parsed when the config is built (a file that is not PEM, or a key that is not its
certificate's, is a usage error naming the flag, not a handshake failure found later) and read
again when credentials are built: replacing them needs a restart.

The gateway's public ports may also terminate TLS (``EdgeTlsFiles``): server authentication
only, since its clients prove who they are with API keys.

Torch-free, so the gateway and the probes can use it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

TLS_FLAGS = ("tls_cert", "tls_key", "tls_ca")


@dataclass(frozen=True)
class TlsFiles:
    """This process's certificate chain and private key, and the deployment CA (PEM files)."""

    cert: Path
    key: Path
    ca: Path
    """The only CA whose certificates this process accepts from a peer, client or server."""

    def __post_init__(self) -> None:
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if not path.is_file() or not os.access(path, os.R_OK):
                raise ValueError(f"--tls-{name}: {path} is not a readable file")
        check_pem_pair(self.cert, self.key, "--tls-cert", "--tls-key")
        load_pem_certificates(self.ca, "--tls-ca")

    def read_pem(self) -> tuple[bytes, bytes, bytes]:
        """(key, cert, ca) bytes."""
        return self.key.read_bytes(), self.cert.read_bytes(), self.ca.read_bytes()


@dataclass(frozen=True)
class EdgeTlsFiles:
    """A public port's certificate chain and key (PEM): TLS that clients verify, without
    client certificates (clients authenticate with API keys)."""

    cert: Path
    key: Path

    def __post_init__(self) -> None:
        for name in ("cert", "key"):
            path = getattr(self, name)
            if not path.is_file() or not os.access(path, os.R_OK):
                raise ValueError(f"--public-tls-{name}: {path} is not a readable file")
        check_pem_pair(self.cert, self.key, "--public-tls-cert", "--public-tls-key")


def load_pem_certificates(path: Path, flag: str) -> list[x509.Certificate]:
    """The certificates of a PEM file (a chain, or a CA bundle); ``ValueError`` naming ``flag``
    when it holds none (gRPC would only log "Invalid cert chain file" and fail every handshake)."""
    try:
        return x509.load_pem_x509_certificates(path.read_bytes())
    except ValueError:
        raise ValueError(f"{flag} {path}: not a PEM certificate") from None


def check_pem_pair(cert: Path, key: Path, cert_flag: str, key_flag: str) -> None:
    """``cert`` is a PEM chain and ``key`` an unencrypted PEM private key for its first
    certificate; ``ValueError`` naming the flag otherwise. The key itself is never shown."""
    leaf = load_pem_certificates(cert, cert_flag)[0]
    try:
        private_key = serialization.load_pem_private_key(key.read_bytes(), password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):  # TypeError: it is encrypted
        raise ValueError(f"{key_flag} {key}: not a PEM private key (unencrypted)") from None
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if private_key.public_key().public_bytes(*spki) != leaf.public_key().public_bytes(*spki):
        raise ValueError(f"{key_flag} {key}: not the private key of {cert_flag} {cert}")


def edge_server_credentials(tls: EdgeTlsFiles) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(tls.key.read_bytes(), tls.cert.read_bytes())])


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """A server that presents ``tls.cert`` and admits only clients with a certificate from
    ``tls.ca``: plaintext clients fail the handshake, as do certificates from any other CA."""
    key, cert, ca = tls.read_pem()
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=True
    )


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """A client that verifies the server against ``tls.ca`` and presents ``tls.cert``."""
    key, cert, ca = tls.read_pem()
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )


def aio_channel(
    target: str, tls: TlsFiles | None, options: Sequence[tuple[str, object]] = ()
) -> grpc.aio.Channel:
    """An asyncio channel to another pdserve process: mutual TLS when ``tls`` is set."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=list(options))
    return grpc.aio.secure_channel(target, channel_credentials(tls), options=list(options))


def sync_channel(
    target: str, tls: TlsFiles | None, options: Sequence[tuple[str, object]] = ()
) -> grpc.Channel:
    """A blocking channel (probes, the launcher): mutual TLS when ``tls`` is set."""
    if tls is None:
        return grpc.insecure_channel(target, options=list(options))
    return grpc.secure_channel(target, channel_credentials(tls), options=list(options))


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    """``--tls-cert``, ``--tls-key``, ``--tls-ca`` (env ``PDSERVE_TLS_*`` via the parser's env
    fallbacks)."""
    add = parser.add_argument
    add("--tls-cert", type=Path, default=None, help="this process's certificate (PEM)")
    add("--tls-key", type=Path, default=None, help="its private key (PEM)")
    add(
        "--tls-ca",
        type=Path,
        default=None,
        help="the deployment CA (PEM): with --tls-cert/--tls-key, internal gRPC is mutual TLS "
        "and peers without a certificate from this CA are refused; unset: plaintext",
    )


def tls_from_args(args: argparse.Namespace) -> TlsFiles | None:
    """None when no TLS flag is set; raises ``ValueError`` when only some are, or a file is
    missing."""
    given = [name for name in TLS_FLAGS if getattr(args, name) is not None]
    if not given:
        return None
    if len(given) != len(TLS_FLAGS):
        missing = [f"--{name.replace('_', '-')}" for name in TLS_FLAGS if name not in given]
        raise ValueError(
            f"TLS needs --tls-cert, --tls-key and --tls-ca together; missing {', '.join(missing)}"
        )
    return TlsFiles(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca)

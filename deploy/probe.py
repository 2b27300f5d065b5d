"""``python -m deploy.probe grpc HOST:PORT | http URL``: exit 0 when healthy, 1 otherwise.

The compose healthchecks run it inside the images (``grpc_health_probe`` is not in them); it
needs only grpcio and grpcio-health-checking, which both images carry.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from deploy.health import GrpcHealth, HealthTarget, HttpHealth
from services.cli import apply_env_defaults
from services.tls import add_tls_flags, tls_from_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.probe", description=__doc__)
    parser.add_argument("kind", choices=["grpc", "http"])
    parser.add_argument("target", help="HOST:PORT for grpc, a URL for http")
    parser.add_argument("--service", default="", help="grpc.health.v1 service name ('' = all)")
    parser.add_argument("--timeout-s", type=float, default=2.0)
    parser.add_argument(
        "--https-ca", type=Path, default=None, help="http: CA of an https URL's certificate"
    )
    add_tls_flags(parser)
    # The container's PDSERVE_TLS_* (the node's own certificate) make the probe speak mTLS.
    apply_env_defaults(parser, os.environ)
    args = parser.parse_args(argv)
    target: HealthTarget
    if args.kind == "grpc":
        try:
            tls = tls_from_args(args)
        except ValueError as exc:
            parser.error(str(exc))
        target = GrpcHealth(args.target, args.service, tls)
    else:
        target = HttpHealth(args.target, args.https_ca)
    healthy = target.check(args.timeout_s)
    print(f"{target}: {'healthy' if healthy else 'not healthy'}")
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())

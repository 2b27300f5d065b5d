"""``python -m gateway``: serve the OpenAI HTTP API and the public gRPC API in front of the
prefill/decode (or colocated) nodes named by the flags. SIGTERM/SIGINT drain and exit 0."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from gateway.config import parse_gateway_config
from gateway.server import GatewayServer
from services.chat_template import ChatTemplateError
from services.listen import ListenError
from services.models import ModelFileError

logger = logging.getLogger("gateway")

DRAIN_GRACE_S = 30.0


async def main(argv: list[str] | None = None) -> int:
    config = parse_gateway_config(argv)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        server = GatewayServer(config)
    except ModelFileError as exc:
        # A model file the flags' checks do not read (a tokenizer file, its chat template):
        # refused like a bad flag, in one line, before any port opens.
        print(f"python -m gateway: error: --model: {exc}", file=sys.stderr)
        return 2
    except ChatTemplateError as exc:
        # --chat-template's template: read at parse time, compiled and tried only here.
        print(f"python -m gateway: error: --chat-template: {exc}", file=sys.stderr)
        return 2
    try:
        await server.start()
    except ListenError as exc:
        logger.error("%s", exc)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    scheme, grpc_tls = ("http", "") if config.public_tls is None else ("https", " (TLS)")
    print(
        f"pdserve gateway ready: HTTP {scheme}://{config.host}:{server.http_port}/v1 "
        f"gRPC{grpc_tls} {config.host}:{server.grpc_port}",
        flush=True,
    )
    await stop.wait()
    logger.info("draining (up to %.0f s)", DRAIN_GRACE_S)
    await server.stop(DRAIN_GRACE_S)
    return 0


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # uvloop is optional: plain asyncio works, a little slower
        pass
    sys.exit(asyncio.run(main()))

"""What a prefill node serves: PrefillService over its engine and KV transport."""

from __future__ import annotations

from pdserve.v1 import prefill_pb2, prefill_pb2_grpc
from prefill_node.servicer import PrefillServicer
from services.async_engine import AsyncEngine
from services.node.config import NodeConfig
from services.node.kv_regions import open_kv_transport
from services.node.metrics import NodeMetrics
from services.node.runtime import NodeServerRef, NodeServices

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name


def prefill_services(
    config: NodeConfig, engine: AsyncEngine, server: NodeServerRef, metrics: NodeMetrics
) -> NodeServices:
    transport = open_kv_transport(
        config.kv_transport,
        engine.engine.kv_caches,
        push_pause_s=config.test_kv_push_pause_s,
    )
    metrics.transport_lanes(transport.info().lanes)
    servicer = PrefillServicer(config, engine, server, transport, metrics)
    return NodeServices(
        service_names=[SERVICE_NAME],
        registrars=[lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, s)],
    )

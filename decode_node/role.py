"""What a decode (or colocated) node serves: DecodeService over its engine."""

from __future__ import annotations

from decode_node.servicer import DecodeServicer
from decode_node.transfers import TransferManager
from pdserve.v1 import decode_pb2, decode_pb2_grpc
from services.async_engine import AsyncEngine
from services.node.config import NodeConfig
from services.node.kv_regions import open_kv_transport
from services.node.metrics import NodeMetrics
from services.node.runtime import NodeServerRef, NodeServices
from services.types import Role

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name


def decode_services(
    config: NodeConfig, engine: AsyncEngine, server: NodeServerRef, metrics: NodeMetrics
) -> NodeServices:
    transfers = None
    if config.role is Role.DECODE:
        transport = open_kv_transport(config.kv_transport, engine.engine.kv_caches)
        metrics.transport_lanes(transport.info().lanes)
        transfers = TransferManager(
            engine,
            transport,
            metrics=metrics,
            max_unstarted=config.max_unstarted_reservations,
            max_waiting=config.max_waiting_reservations,
        )
        transfers.start()
    servicer = DecodeServicer(config, engine, server, transfers, metrics)
    return NodeServices(
        service_names=[SERVICE_NAME],
        registrars=[lambda s: decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, s)],
    )

"""What a decode (or colocated) node serves: DecodeService over its engine."""

from __future__ import annotations

from decode_node.servicer import DecodeServicer
from pdserve.v1 import decode_pb2, decode_pb2_grpc
from services.async_engine import AsyncEngine
from services.node_config import NodeConfig
from services.node_runtime import NodeServerRef, NodeServices

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name


def decode_services(config: NodeConfig, engine: AsyncEngine, server: NodeServerRef) -> NodeServices:
    servicer = DecodeServicer(config, engine, server)
    return NodeServices(
        service_names=[SERVICE_NAME],
        registrars=[lambda s: decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, s)],
    )

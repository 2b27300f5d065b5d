"""Running pdserve: the topology description, the local launcher (``python -m deploy.launch``),
the compose and Envoy generators and the health probe the containers use.

Nothing here imports the engine, the nodes or the gateway: it starts them as processes.
"""

from deploy.topology import (
    EnvoySpec,
    GatewaySpec,
    NodeGroup,
    NodeInstance,
    Role,
    Topology,
    load_topology,
    topology_from_dict,
)

__all__ = [
    "EnvoySpec",
    "GatewaySpec",
    "NodeGroup",
    "NodeInstance",
    "Role",
    "Topology",
    "load_topology",
    "topology_from_dict",
]

"""Where a request runs: ``node`` (a node's routing state) and ``node_client`` (its channel),
``node_pool`` (every node, polled; ``node_discovery`` for ``dns:///`` entries), ``router`` and
``prefix_affinity`` (which pair or colocated node), ``routed_generator`` (attempts, retries,
event order) over ``legs`` (the decode and prefill legs; over gRPC in ``grpc_legs``).

Modules are imported by their full name (no re-exports here), as in ``gateway.http_api``.
"""

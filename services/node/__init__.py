"""The node runtime: what turns the engine into a prefill, decode or colocated node process.

``config`` (flags and ``PDSERVE_*`` variables into a frozen ``NodeConfig``), ``runtime`` (start
the engine, the KV transport and the gRPC server; run until a signal), ``grpc_server`` (health,
reflection, graceful drain), ``kv_regions`` (the KV cache registered with the transport) and
``metrics`` (the node's Prometheus series). The roles (``prefill_node``, ``decode_node``) add
their servicers on top. Nothing here is imported eagerly: the package imports torch only through
the modules that need it.
"""

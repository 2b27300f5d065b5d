"""The decode role: a model replica that receives KV pages into reserved blocks and runs
continuous batching.

Its entry point, gRPC servicer and worker arrive with the decode service; it builds on
``services`` and ``kv_transfer`` and never imports another role.
"""

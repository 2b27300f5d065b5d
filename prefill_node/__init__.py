"""The prefill role: a model replica that only runs prefill and pushes KV pages to decode.

Its entry point, gRPC servicer and worker arrive with the prefill service; it builds on
``services`` and ``kv_transfer`` and never imports another role.
"""

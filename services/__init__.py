"""The shared engine and gRPC plumbing that the prefill and decode roles both run.

``services.engine`` holds the scheduler, the paged KV cache and the model runner;
``services.models`` holds our Llama-family model code, the checkpoint loader and the tiny-model
builder. Nothing here imports a role package (``prefill_node``, ``decode_node``, ``gateway``).
"""

"""The decode role: a model replica that receives KV pages into reserved blocks and runs
continuous batching; with ``--role colocated`` it computes prompts itself.

``python -m decode_node``; ``role.decode_services`` wires ``servicer.DecodeServicer`` into a node.
It builds on ``services`` and ``kv_transfer`` and never imports another role.
"""

"""The standalone KV byte mover: transports (loopback, ucx, cuda_ipc) that copy KV pages from a
prefill node's blocks into a decode node's reserved blocks.

It imports nothing from the rest of pdserve, so either role can use it and it can be tested alone.
"""

"""The gateway: the public gRPC API and the OpenAI-compatible HTTP/SSE bridge, with the
tokenizer and chat template, incremental detokenizer, stop strings and prefill/decode routing.

Nodes are token-in / token-out; only the gateway knows text. It never imports torch.
"""

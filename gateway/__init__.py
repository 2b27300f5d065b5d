"""The gateway: the public gRPC API and the OpenAI-compatible HTTP/SSE bridge, with the
tokenizer and chat template, incremental detokenizer, stop strings and prefill/decode routing.

By layer: ``http_api`` (the OpenAI bridge), ``grpc_api`` (the public gRPC API), ``pipeline``
(admission → tokenize → generate → text, for both), ``text`` (tokenizer, detokenizer, stop
strings), ``routing`` (router, node pool, the routed generator and its legs).

Nodes are token-in / token-out; only the gateway knows text. It never imports torch.
"""

"""Text on the gateway (nodes are token-in / token-out): ``tokenizer`` (HF ``tokenizers`` and
the chat template; a GGUF file's is built by ``services.gguf_tokenizer``), ``detokenizer``
(incremental), ``stop_strings`` and ``text_stream`` (token events → text events).

Modules are imported by their full name (no re-exports here), as in ``gateway.http_api``.
"""

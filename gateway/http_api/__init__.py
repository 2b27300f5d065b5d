"""The OpenAI-compatible HTTP/SSE bridge: one request, read top to bottom.

``http_gate`` (ASGI middleware: auth, per-key limits, body size and read time) →
``openai_app`` (routes) → ``openai_protocol`` (the request models) → ``openai_job`` (checks
that need no tokenizer) → ``generation_response``, which drives the rest in one direction:
``gateway.pipeline`` admission → tokenize (``openai_job.prompt_token_ids``) →
``openai_job.choice_requests`` (one ``GenerationRequest`` per choice) → ``choice_fanout`` (the
choices' ``pipeline.generate_text`` at once) → ``openai_format`` (chunks and bodies) → ``sse`` /
``client_send`` (bounded sends). Errors: ``openai_errors``.

Modules are imported by their full name (no re-exports here): the sub-packages import each
other's modules, and eager re-exports would make that a cycle.
"""

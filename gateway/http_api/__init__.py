"""The OpenAI-compatible HTTP/SSE bridge: one request, read top to bottom.

``openai_app`` (routes, auth) → ``http_gate`` (body size and read time) → ``openai_protocol``
(the request models) → ``openai_job`` (checks that need no tokenizer; later the prompt's token
ids and each choice's ``SamplingParams``) → ``generation_response`` (admission and tokenization
through ``gateway.pipeline``, then the response) → ``choice_fanout`` (the n choices, each a
``pipeline.generate_text``) → ``openai_format`` (chunks and bodies) → ``sse`` /
``client_send`` (bounded sends). Errors: ``openai_errors``.

Modules are imported by their full name (no re-exports here): the sub-packages import each
other's modules, and eager re-exports would make that a cycle.
"""

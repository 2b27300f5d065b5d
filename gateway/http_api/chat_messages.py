"""The checks of an OpenAI request's chat messages that the chat template does not make, shared
by ``/v1/chat/completions`` (and the Responses API, a chat underneath) and ``/tokenize``: the same
messages are refused by both, with the same 400 naming the field."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.errors import invalid
from gateway.http_api.openai_protocol import ChatMessage


def check_chat_messages(messages: Sequence[ChatMessage]) -> None:
    """Raises ``GatewayError`` (400) naming ``messages[i]...``: a tool result without the id of
    the call it answers, or a content part other than text."""
    for index, message in enumerate(messages):
        if message.role == "tool" and not message.tool_call_id:
            # OpenAI refuses it too: a tool result must say which call it answers, and templates
            # that render tool results read the id.
            where = f"messages[{index}].tool_call_id"
            raise invalid(f"{where}: a tool message needs the id of the call it answers", where)
        if isinstance(message.content, list):
            for part_index, part in enumerate(message.content):
                where = f"messages[{index}].content[{part_index}]"
                if part.type != "text":
                    raise invalid(
                        f"{where}: content of type {part.type!r} is not supported; "
                        "this server takes text only",
                        param=f"{where}.type",
                    )
                if part.text is None:
                    raise invalid(f"{where}: a text part needs 'text'", param=f"{where}.text")

"""A client for the Anthropic Messages API with tool use.

``POST {base}/v1/messages`` with ``x-api-key`` and ``anthropic-version``; the
system prompt is the top-level ``system``, the tool is declared with an
``input_schema``. The reply's ``content`` is a list of blocks: ``text``, and
``tool_use`` blocks (``id``, ``name``, ``input`` object) when the model calls
the tool. Results go back in the next user message as ``tool_result`` blocks
(``tool_use_id``, ``content``, ``is_error``), one per call, in order.
"""

from __future__ import annotations

from typing import Any

from .endpoint import Endpoint
from .model import TOOL_DESCRIPTION, TOOL_NAME, TOOL_SCHEMA, Conversation, ModelError, Turn, tool_call

ANTHROPIC_URL = "https://api.anthropic.com"
API_VERSION = "2023-06-01"
# Room for a long command or a full final answer; the API requires a value.
MAX_TOKENS = 4096


def request_body(model: str, conversation: Conversation, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """The Messages request for the conversation so far (pure)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": conversation.task}]
    for item in conversation.history:
        if isinstance(item, Turn):
            content = item.raw if isinstance(item.raw, list) else [{"type": "text", "text": item.text}]
            messages.append({"role": "assistant", "content": content})
        else:
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": r.call_id, "content": r.content, "is_error": r.is_error}
                        for r in item
                    ],
                }
            )
    return {
        "model": model,
        "max_tokens": max_tokens,
        "system": conversation.system,
        "messages": messages,
        "tools": [{"name": TOOL_NAME, "description": TOOL_DESCRIPTION, "input_schema": TOOL_SCHEMA}],
    }


def parse_response(data: dict[str, Any]) -> Turn:
    """The assistant turn in a Messages response (pure); ModelError when there is none."""
    content = data.get("content")
    if not isinstance(content, list):
        raise ModelError("the endpoint's answer has no content")
    texts: list[str] = []
    calls = []
    for block in content:
        if not isinstance(block, dict):
            raise ModelError("the endpoint's answer has a malformed content block")
        if block.get("type") == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif block.get("type") == "tool_use":
            if not isinstance(block.get("id"), str):
                raise ModelError("the endpoint's answer has a tool_use block without an id")
            calls.append(tool_call(block["id"], str(block.get("name", "")), block.get("input", {})))
    # The blocks go back verbatim: a tool_result must answer the exact tool_use it names.
    return Turn(text="\n".join(texts), calls=tuple(calls), raw=content)


class AnthropicMessagesModel:
    """``next_turn`` = one POST to ``{base_url}/v1/messages``."""

    def __init__(
        self, *, endpoint: Endpoint, base_url: str, model: str, api_key: str, max_tokens: int = MAX_TOKENS
    ) -> None:
        self.endpoint = endpoint
        self.url = base_url.rstrip("/") + "/v1/messages"
        self.model = model
        self.max_tokens = max_tokens
        self._api_key = api_key
        self.description = f"{model} at {base_url}"

    async def next_turn(self, conversation: Conversation) -> Turn:
        headers = {"x-api-key": self._api_key, "anthropic-version": API_VERSION}
        data = await self.endpoint.post(self.url, request_body(self.model, conversation, self.max_tokens), headers)
        try:
            return parse_response(data)
        except ModelError as exc:
            raise ModelError(f"{self.endpoint.provider}: {exc}") from None

    async def close(self) -> None:
        await self.endpoint.close()

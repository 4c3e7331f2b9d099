"""A client for any OpenAI-compatible Chat Completions endpoint with tool calling.

OpenAI itself, vLLM, Ollama, llama.cpp's server, LiteLLM, ...: ``POST
{base}/chat/completions`` with ``Authorization: Bearer KEY`` (no header when
there is no key), the tool as a ``function``; the reply's
``choices[0].message`` carries ``tool_calls`` (``arguments`` a JSON text) or,
with none, the final answer in ``content``. Each tool result goes back as a
``{"role": "tool", "tool_call_id", "content"}`` message.
"""

from __future__ import annotations

import json
from typing import Any

from .endpoint import Endpoint
from .model import TOOL_DESCRIPTION, TOOL_NAME, TOOL_SCHEMA, Conversation, ModelError, Turn, tool_call

OPENAI_URL = "https://api.openai.com/v1"


def _text(content: Any) -> str:
    """``content`` as text: a string, null, or (some servers) a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return str(content)


def request_body(model: str, conversation: Conversation) -> dict[str, Any]:
    """The Chat Completions request for the conversation so far (pure)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": conversation.system},
        {"role": "user", "content": conversation.task},
    ]
    for item in conversation.history:
        if isinstance(item, Turn):
            message = item.raw if isinstance(item.raw, dict) else {"role": "assistant", "content": item.text}
            messages.append(message)
        else:
            messages.extend({"role": "tool", "tool_call_id": r.call_id, "content": r.content} for r in item)
    return {
        "model": model,
        "messages": messages,
        "tools": [
            {
                "type": "function",
                "function": {"name": TOOL_NAME, "description": TOOL_DESCRIPTION, "parameters": TOOL_SCHEMA},
            }
        ],
    }


def parse_response(data: dict[str, Any]) -> Turn:
    """The assistant turn in a Chat Completions response (pure); ModelError when there is none."""
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ModelError("the endpoint's answer has no choices")
    message = choices[0].get("message")
    if not isinstance(message, dict):
        raise ModelError("the endpoint's answer has no message")
    text = _text(message.get("content"))
    calls = []
    echoed = []
    for n, call in enumerate(message.get("tool_calls") or []):
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise ModelError("the endpoint's answer has a malformed tool call")
        function = call["function"]
        # Some servers leave out the id; the tool message must still name one.
        call_id = str(call.get("id") or f"call_{n}")
        arguments = function.get("arguments", "")
        calls.append(tool_call(call_id, str(function.get("name", "")), arguments))
        echoed.append(
            {
                "id": call_id,
                "type": "function",
                "function": {
                    "name": function.get("name", ""),
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
        )
    # Sent back in the next request: only the fields every compatible server accepts.
    raw: dict[str, Any] = {
        "role": "assistant",
        "content": message.get("content") if isinstance(message.get("content"), str) else text or None,
    }
    if echoed:
        raw["tool_calls"] = echoed
    return Turn(text=text, calls=tuple(calls), raw=raw)


class OpenAIChatModel:
    """``next_turn`` = one POST to ``{base_url}/chat/completions``."""

    def __init__(self, *, endpoint: Endpoint, base_url: str, model: str, api_key: str | None) -> None:
        self.endpoint = endpoint
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self._api_key = api_key
        self.description = f"{model} at {base_url}"

    async def next_turn(self, conversation: Conversation) -> Turn:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        data = await self.endpoint.post(self.url, request_body(self.model, conversation), headers)
        try:
            return parse_response(data)
        except ModelError as exc:
            raise ModelError(f"{self.endpoint.provider}: {exc}") from None

    async def close(self) -> None:
        await self.endpoint.close()

"""Local fake model servers speaking the real wire formats: OpenAI Chat Completions and Anthropic Messages.

Usage::

    async with FakeModelServer("openai", key="sk-test", actions=[{"command": "ls"}, {"final_echo": True}]) as fake:
        ... point a client at fake.base_url (openai: ends in /v1; anthropic: the bare origin) ...
        fake.requests  # [(headers, body), ...]

Each request is checked the way the real API checks it, in this order:
the key (401, in the API's own error shape), the model name (404), the
request's shape (400: tool results must answer exactly the tool calls of the
assistant message before them; Anthropic roles must alternate, ``max_tokens``
and ``anthropic-version`` are required). Then it consumes the next action:

- ``{"command": "..."}``: a turn that calls the ``bash`` tool;
- ``{"final": "..."}``: a text-only turn (the final answer);
- ``{"final_echo": True}``: a final answer quoting the last tool result;
- ``{"status": 429|500|529|..., "retry_after": "1", "retry_after_ms": "150",
  "code": "..."}``: that error, in the API's shape;
- ``{"hang": seconds}``: answer only after that long (request timeouts);
- ``{"tool": "name", "arguments": ...}``: a call of some other tool, or with
  raw arguments (malformed calls).

With no action left it answers a final "(fake: out of actions)".
"""

from __future__ import annotations

import asyncio
import json
import time
from types import TracebackType
from typing import Any

from aiohttp import web

_OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    429: "requests",
    500: "server_error",
    503: "server_error",
}
_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


class FakeModelServer:
    def __init__(
        self,
        api: str,
        *,
        key: str | None = "test-key",
        models: tuple[str, ...] = ("test-model",),
        actions: list[dict[str, Any]] | None = None,
        echo_key_in_401: bool = False,
    ) -> None:
        assert api in ("openai", "anthropic")
        self.api = api
        self.key = key
        self.models = set(models)
        self.actions = list(actions or [])
        self.echo_key_in_401 = echo_key_in_401
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.times: list[float] = []
        self._runner: web.AppRunner | None = None
        self.port = 0
        self._n = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}" + ("/v1" if self.api == "openai" else "")

    async def __aenter__(self) -> FakeModelServer:
        app = web.Application()
        path = "/v1/chat/completions" if self.api == "openai" else "/v1/messages"
        app.router.add_post(path, self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    # -- errors in each API's shape --------------------------------------------------

    def _error(
        self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None
    ) -> web.Response:
        if self.api == "openai":
            body: dict[str, Any] = {
                "error": {
                    "message": message,
                    "type": _OPENAI_ERROR_TYPES.get(status, "invalid_request_error"),
                    "param": None,
                    "code": code,
                }
            }
        else:
            error: dict[str, Any] = {"type": _ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}
            if code:
                error["details"] = {"error_code": code}
            body = {"type": "error", "error": error, "request_id": f"req_{self._n}"}
        return web.json_response(body, status=status, headers=headers)

    # -- the request -------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.Response:
        self._n += 1
        self.times.append(time.monotonic())
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return self._error(400, "the body is not JSON")
        self.requests.append((dict(request.headers), body))
        if self.api == "openai":
            auth = request.headers.get("Authorization", "")
            given = auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None
        else:
            given = request.headers.get("x-api-key")
        if self.key is not None and given != self.key:
            if self.api == "openai":
                shown = given if self.echo_key_in_401 else (given[:3] + "****" + given[-4:] if given else "")
                return self._error(
                    401,
                    f"Incorrect API key provided: {shown}. You can find your API key at "
                    "https://platform.openai.com/account/api-keys.",
                    "invalid_api_key",
                )
            return self._error(401, "invalid x-api-key")
        model = body.get("model")
        if model not in self.models:
            if self.api == "openai":
                return self._error(
                    404, f"The model `{model}` does not exist or you do not have access to it.", "model_not_found"
                )
            return self._error(404, f"model: {model}")
        problem = self._check_openai(body) if self.api == "openai" else self._check_anthropic(request, body)
        if problem:
            return self._error(400, problem)
        action = self.actions.pop(0) if self.actions else {"final": "(fake: out of actions)"}
        if "hang" in action:
            await asyncio.sleep(action["hang"])
            action = self.actions.pop(0) if self.actions else {"final": "(fake: out of actions)"}
        if "status" in action:
            headers = {}
            if "retry_after" in action:
                headers["retry-after"] = action["retry_after"]
            if "retry_after_ms" in action:
                headers["retry-after-ms"] = action["retry_after_ms"]
            return self._error(action["status"], action.get("message", "fake failure"), action.get("code"), headers)
        if "final_echo" in action:
            action = {"final": "saw: " + self._last_tool_result(body)}
        return web.json_response(self._turn(model, action))

    def _last_tool_result(self, body: dict[str, Any]) -> str:
        for message in reversed(body["messages"]):
            if self.api == "openai" and message.get("role") == "tool":
                return str(message["content"])
            if self.api == "anthropic" and isinstance(message.get("content"), list):
                for block in message["content"]:
                    if block.get("type") == "tool_result":
                        return str(block["content"])
        return ""

    def _turn(self, model: str, action: dict[str, Any]) -> dict[str, Any]:
        n = self._n
        if "final" in action:
            if self.api == "openai":
                message = {"role": "assistant", "content": action["final"], "refusal": None}
                return self._completion(model, message, "stop")
            return self._message(model, [{"type": "text", "text": action["final"]}], "end_turn")
        name = action.get("tool", "bash")
        arguments = action["arguments"] if "arguments" in action else {"command": action["command"]}
        if self.api == "openai":
            text_args = arguments if isinstance(arguments, str) else json.dumps(arguments)
            message = {
                "role": "assistant",
                "content": None,
                "refusal": None,
                "tool_calls": [
                    {"id": f"call_{n:04d}", "type": "function", "function": {"name": name, "arguments": text_args}}
                ],
            }
            return self._completion(model, message, "tool_calls")
        return self._message(
            model,
            [
                {"type": "text", "text": "I will run a command."},
                {"type": "tool_use", "id": f"toolu_{n:04d}", "name": name, "input": arguments},
            ],
            "tool_use",
        )

    def _completion(self, model: str, message: dict[str, Any], finish: str) -> dict[str, Any]:
        return {
            "id": f"chatcmpl-{self._n}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
            "system_fingerprint": "fp_fake",
        }

    def _message(self, model: str, content: list[dict[str, Any]], stop: str) -> dict[str, Any]:
        return {
            "id": f"msg_{self._n:04d}",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": {"input_tokens": 10, "output_tokens": 5},
        }

    # -- what the real APIs refuse with 400 --------------------------------------------

    @staticmethod
    def _check_openai(body: dict[str, Any]) -> str | None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "'messages' must be a non-empty array"
        tools = body.get("tools") or []
        for tool in tools:
            if tool.get("type") != "function" or not isinstance(tool.get("function", {}).get("parameters"), dict):
                return "tools[].type must be 'function' with function.parameters"
        pending: set[str] = set()
        for i, message in enumerate(messages):
            role = message.get("role")
            if role not in ("system", "user", "assistant", "tool"):
                return f"messages[{i}].role: invalid value {role!r}"
            if role == "tool":
                if message.get("tool_call_id") not in pending:
                    return f"messages[{i}]: a 'tool' message must respond to a preceding message with 'tool_calls'"
                if not isinstance(message.get("content"), str):
                    return f"messages[{i}].content must be a string"
                pending.discard(message["tool_call_id"])
                continue
            if pending:
                return (
                    "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
                    "'tool_call_id'. The following tool_call_ids did not have response messages: "
                    + ", ".join(sorted(pending))
                )
            if role == "assistant":
                calls = message.get("tool_calls") or []
                if message.get("content") is None and not calls:
                    return f"messages[{i}]: an assistant message needs content or tool_calls"
                for call in calls:
                    if call.get("type") != "function" or not isinstance(call.get("function", {}).get("arguments"), str):
                        return f"messages[{i}].tool_calls: each needs type 'function' and string arguments"
                    pending.add(call["id"])
            elif not isinstance(message.get("content"), str):
                return f"messages[{i}].content must be a string"
        if pending:
            return "the last assistant message's tool calls have no tool responses"
        return None

    @staticmethod
    def _check_anthropic(request: web.Request, body: dict[str, Any]) -> str | None:
        if not request.headers.get("anthropic-version"):
            return "anthropic-version: header is required"
        if not isinstance(body.get("max_tokens"), int):
            return "max_tokens: Field required"
        if "system" in body and not isinstance(body["system"], str | list):
            return "system: Input should be a valid string"
        for tool in body.get("tools") or []:
            if not isinstance(tool.get("input_schema"), dict) or not tool.get("name"):
                return "tools: each tool needs name and input_schema"
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "messages: at least one message is required"
        expected = "user"
        open_uses: list[str] = []
        for i, message in enumerate(messages):
            if message.get("role") != expected:
                return f'messages: roles must alternate between "user" and "assistant" (messages.{i})'
            content = message.get("content")
            blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
            if not isinstance(blocks, list) or not blocks:
                return f"messages.{i}: all messages must have non-empty content"
            results = [b.get("tool_use_id") for b in blocks if b.get("type") == "tool_result"]
            if expected == "user":
                if sorted(results) != sorted(open_uses):
                    return (
                        f"messages.{i}: `tool_use` ids were found without `tool_result` blocks immediately after: "
                        f"{', '.join(open_uses)}. Each `tool_use` block must have a corresponding `tool_result` "
                        "block in the next message."
                    )
                for b in blocks:
                    if b.get("type") == "tool_result" and not isinstance(b.get("content"), str | list):
                        return f"messages.{i}: tool_result content must be a string or a list of blocks"
                open_uses = []
                expected = "assistant"
            else:
                if results:
                    return f"messages.{i}: tool_result blocks are only allowed in user messages"
                open_uses = [b["id"] for b in blocks if b.get("type") == "tool_use"]
                expected = "user"
        if open_uses or expected != "assistant":
            return "messages: the last message must be a user message answering every tool_use"
        return None

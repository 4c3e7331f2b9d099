"""What a model client and the loop exchange, in no provider's format.

The loop keeps a ``Conversation`` (system prompt, task, then alternating
assistant ``Turn``s and the ``ToolResult``s of their calls); a client renders
it to its wire format, sends it, and parses the reply into the next ``Turn``.
A turn without tool calls is the model's final answer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

# The one tool: its name, what the model is told about it, and its arguments
# as a JSON Schema (both APIs take the same schema).
TOOL_NAME = "bash"
TOOL_DESCRIPTION = (
    "Run one shell command in the sandbox and return its exit code, stdout, stderr, "
    "any limit it hit and every network request the egress proxy refused."
)
TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"command": {"type": "string", "description": "the shell command to run"}},
    "required": ["command"],
}


class ModelError(Exception):
    """The model gave no usable answer: bad key, unknown model, endpoint down after retries, bad reply."""


@dataclass(frozen=True)
class ToolCall:
    """One call of the tool. ``problem`` says why it cannot run (``command`` is then the raw arguments)."""

    id: str
    command: str
    problem: str | None = None


@dataclass(frozen=True)
class Turn:
    """One assistant message: its text, its tool calls, and the provider's own form to send back."""

    text: str
    calls: tuple[ToolCall, ...] = ()
    raw: Any = None


@dataclass(frozen=True)
class ToolResult:
    call_id: str
    content: str
    is_error: bool


@dataclass
class Conversation:
    system: str
    task: str
    history: list[Turn | tuple[ToolResult, ...]] = field(default_factory=list)


class Model(Protocol):
    """A client for one model; ``next_turn`` raises ModelError when it cannot answer."""

    description: str

    async def next_turn(self, conversation: Conversation) -> Turn: ...

    async def close(self) -> None: ...


def tool_call(call_id: str, name: str, arguments: Any) -> ToolCall:
    """Build a ToolCall from a provider's (name, arguments), saying what is wrong with a bad one (pure).

    ``arguments`` is a JSON object or its text (OpenAI sends text, Anthropic an object).
    """
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    if name != TOOL_NAME:
        return ToolCall(call_id, raw, f"there is no tool {name!r}; the only tool is {TOOL_NAME}(command)")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(call_id, raw, 'the arguments are not valid JSON; send {"command": "..."}')
    command = arguments.get("command") if isinstance(arguments, dict) else None
    if not isinstance(command, str) or not command.strip():
        return ToolCall(call_id, raw, 'the arguments need a non-empty string "command"')
    return ToolCall(call_id, command)

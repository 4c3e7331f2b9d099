"""``--model script:FILE``: a model that replays a fixed list of steps, for tests and demos.

The file is a JSON list; each item is ``{"command": "..."}`` (run it) or
``{"final": "..."}`` (answer and stop), e.g.::

    [{"command": "echo hello > greeting.txt"},
     {"command": "curl -sS https://example.com/"},
     {"final": "wrote greeting.txt"}]

Steps are replayed in order whatever the commands printed. A script that
runs out before a ``final`` ends the run with stop ``error``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .model import Conversation, ModelError, ToolCall, Turn


class ScriptError(ValueError):
    """The script file cannot be read or is not a list of steps."""


@dataclass(frozen=True)
class ScriptStep:
    command: str | None = None
    final: str | None = None


def parse_script(data: Any) -> list[ScriptStep]:
    """Validate a decoded script (pure): a non-empty list of {"command"} / {"final"} objects."""
    if not isinstance(data, list) or not data:
        raise ScriptError('a script is a non-empty JSON list of {"command": ...} / {"final": ...} steps')
    steps = []
    for n, item in enumerate(data, 1):
        if not isinstance(item, dict) or len(item) != 1 or not ({"command", "final"} & item.keys()):
            raise ScriptError(
                f'step {n}: expected {{"command": "..."}} or {{"final": "..."}}, got {json.dumps(item)[:80]}'
            )
        key, value = next(iter(item.items()))
        if not isinstance(value, str) or (key == "command" and not value.strip()):
            raise ScriptError(f"step {n}: {key!r} must be a {'non-empty ' if key == 'command' else ''}string")
        steps.append(ScriptStep(command=value) if key == "command" else ScriptStep(final=value))
    return steps


def load_script(path: Path) -> list[ScriptStep]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScriptError(f"cannot read {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScriptError(f"{path} is not JSON: {exc}") from None
    try:
        return parse_script(data)
    except ScriptError as exc:
        raise ScriptError(f"{path}: {exc}") from None


class ScriptModel:
    """Answers each turn with the next step of the script."""

    def __init__(self, steps: list[ScriptStep], name: str = "script") -> None:
        self.steps = list(steps)
        self.description = name
        self._next = 0

    async def next_turn(self, conversation: Conversation) -> Turn:
        if self._next >= len(self.steps):
            raise ModelError(f"the script ended after {len(self.steps)} steps without a final answer")
        step = self.steps[self._next]
        self._next += 1
        if step.final is not None:
            return Turn(text=step.final)
        assert step.command is not None
        return Turn(text="", calls=(ToolCall(id=f"script-{self._next}", command=step.command),))

    async def close(self) -> None:
        return None

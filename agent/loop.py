"""The agent loop: ask the model, run its commands in the sandbox, show it what happened.

    outcome = await run_agent(model, executor, conversation, limits=..., max_steps=30)

Each turn (1) asks the model for its next turn; a turn without tool calls is
the final answer; (2) runs each call as one step: the run's current command
is set on egressd (approval messages show it), the command runs in the
sandbox, the command is cleared; (3) hands the observations back. It stops
with:

- ``final``: the model answered;
- ``max_steps``: ``max_steps`` commands ran and the model wanted more;
- ``timeouts``: two commands in a row ran past their time limit (a model
  that keeps starting servers or waiting on input makes no progress);
- ``error``: the model failed (ModelError) or a command could not be started
  (ExecutorError).

The loop knows the sandbox only through ``Executor``; ``cli`` implements it
on a ``SandboxSession``. Copy-out and destroying the sandbox are the
caller's, so they happen whatever the loop did.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from egressd.sandbox.backend import Observation

from .model import Conversation, Model, ModelError, ToolCall, ToolResult, Turn
from .prompt import render_observation

DEFAULT_MAX_STEPS = 30
# Two in a row: one timeout may be a slow download worth a retry; two is a pattern.
TIMEOUTS_IN_A_ROW = 2


class ExecutorError(Exception):
    """A command could not be started in the sandbox."""


class Executor(Protocol):
    """Where commands run: the sandbox, seen from the loop."""

    def set_command(self, command: str | None) -> None:
        """What the run executes now (None between commands)."""

    async def run(self, command: str) -> Observation:
        """Run one shell command to completion or its limits; ``egress_refusals`` filled in."""


class Stop(enum.Enum):
    FINAL = "final"
    MAX_STEPS = "max_steps"
    TIMEOUTS = "timeouts"
    ERROR = "error"


@dataclass
class Step:
    """One tool call: the command and what it did (``observation`` None when it could not run)."""

    number: int
    command: str
    observation: Observation | None
    problem: str | None = None

    def record(self) -> dict[str, Any]:
        """The step as one transcript line (DESIGN.md, ``egressd agent --transcript``)."""
        obs = self.observation
        return {
            "step": self.number,
            "command": self.command,
            "exit_code": obs.exit_code if obs else None,
            "stdout": obs.stdout if obs else "",
            "stderr": obs.stderr if obs else (self.problem or ""),
            "timed_out": obs.timed_out if obs else False,
            "memory_exceeded": obs.memory_exceeded if obs else False,
            "egress_refusals": [
                {"host": r.host, "port": r.port, "reason": r.reason}
                for r in (obs.egress_refusals if obs else [])
            ],
        }


@dataclass
class AgentOutcome:
    """How the agent's loop ended: why it stopped, its final answer or error, and every step."""

    stop: Stop
    final: str | None = None
    error: str | None = None
    error_in: str | None = None  # "model" or "sandbox" when stop is ERROR
    steps: list[Step] = field(default_factory=list)


class Reporter(Protocol):
    """Told what happens as it happens (cli prints progress and writes the transcript)."""

    def model_said(self, text: str) -> None: ...

    def step_started(self, number: int, max_steps: int, command: str) -> None: ...

    def step_finished(self, step: Step, max_steps: int) -> None: ...


class SilentReporter:
    def model_said(self, text: str) -> None:
        pass

    def step_started(self, number: int, max_steps: int, command: str) -> None:
        pass

    def step_finished(self, step: Step, max_steps: int) -> None:
        pass


async def _run_call(call: ToolCall, number: int, executor: Executor) -> Step:
    if call.problem is not None:
        return Step(number, call.command, None, f"not run: {call.problem}")
    executor.set_command(call.command)
    try:
        observation = await executor.run(call.command)
    finally:
        executor.set_command(None)
    return Step(number, call.command, observation)


def _result(call: ToolCall, step: Step, timeout_s: float | None, memory_mb: int | None) -> ToolResult:
    if step.observation is None:
        return ToolResult(call.id, f"error: {step.problem}", is_error=True)
    content = render_observation(step.observation, timeout_s=timeout_s, memory_mb=memory_mb)
    return ToolResult(call.id, content, is_error=step.observation.exit_code != 0)


async def run_agent(
    model: Model,
    executor: Executor,
    conversation: Conversation,
    *,
    max_steps: int = DEFAULT_MAX_STEPS,
    timeout_s: float | None = None,
    memory_mb: int | None = None,
    reporter: Reporter | None = None,
) -> AgentOutcome:
    """Drive the model until it answers or a stop rule ends the run (see the module docstring)."""
    if max_steps < 1:
        raise ValueError("max_steps must be at least 1")
    report = reporter or SilentReporter()
    outcome = AgentOutcome(Stop.ERROR)
    timeouts_in_a_row = 0
    while True:
        try:
            turn: Turn = await model.next_turn(conversation)
        except ModelError as exc:
            outcome.error, outcome.error_in = str(exc), "model"
            return outcome
        conversation.history.append(turn)
        if not turn.calls:
            outcome.stop, outcome.final = Stop.FINAL, turn.text
            return outcome
        if turn.text.strip():
            report.model_said(turn.text)
        results: list[ToolResult] = []
        for call in turn.calls:
            number = len(outcome.steps) + 1
            report.step_started(number, max_steps, call.command)
            try:
                step = await _run_call(call, number, executor)
            except ExecutorError as exc:
                outcome.error, outcome.error_in = str(exc), "sandbox"
                return outcome
            outcome.steps.append(step)
            report.step_finished(step, max_steps)
            results.append(_result(call, step, timeout_s, memory_mb))
            timeouts_in_a_row = timeouts_in_a_row + 1 if step.observation and step.observation.timed_out else 0
            if timeouts_in_a_row >= TIMEOUTS_IN_A_ROW:
                outcome.stop = Stop.TIMEOUTS
                return outcome
            if len(outcome.steps) >= max_steps:
                outcome.stop = Stop.MAX_STEPS
                return outcome
        conversation.history.append(tuple(results))

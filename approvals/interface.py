"""What the proxy asks and what comes back: the only meeting point of the
proxy and whatever answers (the ``deny`` approver here, the broker and its
channels later).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol


class Answer(enum.Enum):
    """How an approval ended. Everything but ALLOW fails the request."""

    ALLOW = "allow"
    DENY = "deny"
    TIMEOUT = "timeout"
    NO_APPROVER = "no_approver"
    TOO_MANY_PENDING = "too_many_pending"


@dataclass(frozen=True, slots=True)
class ApprovalRequest:
    """A held connection's question: may this run reach host:port?"""

    run_id: str
    host: str
    port: int
    command: str | None
    task: str | None
    allowed: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ApprovalOutcome:
    """The answer, with who gave it, through which channel, after how long."""

    answer: Answer
    approval_id: str | None = None
    channel: str | None = None
    by: str | None = None
    waited_s: float = 0.0

    @property
    def allowed(self) -> bool:
        return self.answer is Answer.ALLOW


class Approver(Protocol):
    """Answers approval requests. Must never raise for a denial: a denial is
    an outcome. An exception is treated by the caller as a denial (fail
    closed)."""

    async def ask(self, request: ApprovalRequest) -> ApprovalOutcome: ...

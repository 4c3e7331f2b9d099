"""The two approvers that need no person: ``deny`` and nobody at all."""

from __future__ import annotations

from .interface import Answer, ApprovalOutcome, ApprovalRequest


class DenyApprover:
    """``--approver deny``: every request is denied at once (tests, unattended runs)."""

    async def ask(self, request: ApprovalRequest) -> ApprovalOutcome:
        return ApprovalOutcome(Answer.DENY, channel="deny", by="deny")


class NoApprover:
    """No channel attached: the request fails as ``no_approver``."""

    async def ask(self, request: ApprovalRequest) -> ApprovalOutcome:
        return ApprovalOutcome(Answer.NO_APPROVER)

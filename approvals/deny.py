"""The two approvers that need no person: ``deny`` and nobody at all."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from egressd.audit.approvalrecords import approval_decided_record, approval_requested_record
from egressd.audit.log import AuditError, AuditSink
from egressd.vocabulary.egress import Decision
from egressd.vocabulary.reasons import ANSWER_REASONS, Answer

from .broker import new_approval_id
from .interface import ApprovalOutcome, ApprovalRequest

log = logging.getLogger("egressd.approvals")


class DenyApprover:
    """``--approver deny``: every request is denied at once (tests, unattended runs).

    Every approval has an id, this one's too (DESIGN.md "The new-domain
    approval message"): each denial is an ``approval.requested`` /
    ``approval.decided`` pair in the audit log, and the held request's
    ``egress`` record names it. A record that cannot be written changes
    nothing: the answer is a denial either way.
    """

    def __init__(
        self,
        *,
        audit: AuditSink | None = None,
        clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = new_approval_id,
    ) -> None:
        self._audit = audit
        self._clock = clock
        self._new_id = new_id

    async def ask(self, request: ApprovalRequest) -> ApprovalOutcome:
        approval_id = self._new_id()
        if self._audit is not None:
            now = self._clock()
            try:
                self._audit.write(
                    approval_requested_record(
                        id=approval_id,
                        ts=now,
                        run=request.run_id,
                        host=request.host,
                        port=request.port,
                        command=request.command,
                        channels=("deny",),
                    )
                )
                self._audit.write(
                    approval_decided_record(
                        id=approval_id,
                        ts=now,
                        decision=Decision.DENY,
                        reason=ANSWER_REASONS[Answer.DENY],
                        channel="deny",
                        by="deny",
                        waited_s=0.0,
                        run=request.run_id,
                    )
                )
            except AuditError:
                log.error("approval %s: the deny approver's records could not be written (denied anyway)", approval_id)
        return ApprovalOutcome(Answer.DENY, approval_id=approval_id, channel="deny", by="deny", waited_s=0.0)


class NoApprover:
    """No channel attached: the request fails as ``no_approver``."""

    async def ask(self, request: ApprovalRequest) -> ApprovalOutcome:
        return ApprovalOutcome(Answer.NO_APPROVER)

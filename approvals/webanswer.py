"""What the approvals page says after an answer, and the page in a fleet: what the other instances hold, shown as
this instance's own, and answers to it passed to the holder (``interface.Elsewhere``)."""

from __future__ import annotations

from typing import Any

from .control import Scope
from .interface import Answered, AnswerResult, ApprovalScope, ChannelError, Choice, Elsewhere, settled_text
from .webview import run_row, shown


def answer_flash(answered: Answered, choice: Choice, scope: ApprovalScope, shown_id: str, what: str) -> str:
    """The line the page shows after an answer: decided (how), not offered, already settled, or unknown."""
    if answered.result is AnswerResult.NOT_OFFERED:
        why = ": egressd has no allow file (--allow-file)" if scope is ApprovalScope.ALWAYS else ""
        return f"Not answered: {scope.value} is not offered for {shown_id}{why}."
    if answered.result is AnswerResult.ACCEPTED:
        if answered.settlement is not None:
            return f"{what}: {settled_text(answered.settlement)}."
        return f"{choice.value.capitalize()}ed {what}."
    if answered.result is AnswerResult.SETTLED:
        how = settled_text(answered.settlement) if answered.settlement else "settled"
        return f"Approval {shown_id} was already settled: {how}."
    if answered.result is AnswerResult.NOT_APPLIED:
        return (f"Not answered: approval {shown_id} is held by another instance of the fleet, which did not take "
                "the answer in time; nothing was decided, answer again.")  # fmt: skip
    return f"No pending approval {shown_id}."


def remote_event(listing: dict[str, Any], scope: Scope) -> dict[str, Any] | None:
    """Another instance's approval as this page shows it (its holder drew it: ``listing["page"]``), with the
    answers offered to a session of ``scope`` and the instance that holds it; None when it cannot be shown."""
    page = listing.get("page")
    if not isinstance(page, dict) or not isinstance(page.get("id"), str):
        return None
    offered = [s for s in page.get("scopes") or () if scope.outlives_runs or s != ApprovalScope.ALWAYS.value]
    return page | {"scopes": offered, "instance": str(listing.get("instance") or "")}


async def waiting_elsewhere(elsewhere: Elsewhere | None, scope: Scope) -> list[dict[str, Any]]:
    """What the other instances of the fleet hold that a session of ``scope`` may see, as page events."""
    if elsewhere is None:
        return []
    shown = (remote_event(listing, scope) for run, listing in await elsewhere.listed() if scope.covers(run))
    return [event for event in shown if event is not None]


async def runs_elsewhere(elsewhere: Elsewhere | None, scope: Scope) -> list[dict[str, Any]]:
    """The other instances' live runs, as the page's runs table shows them, with their ``instance``; for a
    session of the global token only (a run's session sees its own run)."""
    if elsewhere is None or not scope.outlives_runs:
        return []
    return [run_row(run) | {"instance": shown(instance)} for instance, run in await elsewhere.runs()]


async def answer_elsewhere(
    elsewhere: Elsewhere | None, approval_id: str, choice: Choice, scope: ApprovalScope, *, session: Scope, by: str,
    auth: str | None, shown_id: str, channel: str,
) -> tuple[bool, str] | None:
    """An answer to an approval another instance holds: (allowed to answer, the line to show); None when no
    other instance holds ``approval_id`` (it is this instance's to answer, or unknown)."""
    if elsewhere is None:
        return None
    try:
        run = await elsewhere.run_of(approval_id)
        if run is None:
            return None
        if not session.covers(run):
            return False, f"This session acts on run {session.run_id} only."
        answered = await elsewhere.answer(approval_id, choice, channel=channel, by=by, scope=scope, auth=auth)
    except ChannelError as exc:
        return True, f"Not answered: {exc}."
    return True, answer_flash(answered, choice, scope, shown_id, f"Approval {shown_id}")

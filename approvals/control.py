"""The control API's approval routes, behind its bearer token (``egressd pending|allow|deny`` use them).

- ``GET /approvals``                 every approval still waiting, oldest first (``abandoned``:
                                     every client waiting for it gave up; an answer still applies to its run)
- ``POST /approvals/{id}/allow``     answer allow; body optional ``{"by": "who", "scope": "once"|"run"|"always"}``
                                     (defaults ``cli`` and ``run``)
- ``POST /approvals/{id}/deny``      answer deny; body optional ``{"by": "who"}`` (a scope is ignored)

Answers go through the ``Answerer`` (the broker) with channel ``control``:
200 ``{"id", "decision", "by", "scope", "entry", "scope_error"}`` when it
decided (``scope`` as applied, null for a denial; ``entry`` what an *always*
answer appended to the allowlist file; ``scope_error`` why an *always* was
applied to the run only), 409 when the approval was already settled (the
body says how), 404 for an unknown id, 400 for a scope that is not one of
the three or not offered (*always* without ``--allow-file``; nothing is
decided).

Who may see and answer what is the caller's ``Scope``, which the control
API's token check puts on every request (``request[SCOPE]``; a request
without one is a bug and fails, never answered): the global token's scope is
every run; a run's own control token's is that run, so the list holds its
approvals alone and an answer to another run's approval is refused with 403
(nothing is answered). To a run's token an approval no longer pending is
unknown (404), whoever's it was: its settlement is not shown, since it may
be another run's. Nor may a run's token answer *always* (403, nothing
decided): that outlives the run, appending to the operator's allow file for
every run, so only the global token may.

``by`` is the caller's free text; the ``approval.decided`` record names the
credential apart from it, as ``auth`` (``Scope.auth``: ``global token`` or
``run token of r-1``).

In a fleet (``serve --state``, an ``Elsewhere``), the list also holds the
approvals the other instances hold (each with its ``instance``), and an
answer to one of them is passed to its holder, which decides: the same
answers come back, and 503 when the holder did not take it in time
(nothing was decided). A run's token acts on its own run's approvals
fleet-wide, and on no other's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from egressd.audit.records import rfc3339
from egressd.vocabulary.egress import Decision

from .interface import (
    Answered,
    Answerer,
    AnswerResult,
    ApprovalScope,
    ChannelError,
    Choice,
    Elsewhere,
    PendingApproval,
    Route,
    parse_scope,
    settled_text,
)

CHANNEL = "control"
DEFAULT_BY = "cli"
MAX_BODY_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Scope:
    """The runs a control API caller may act on: ``run_id`` alone, or every run (None: the global token)."""

    run_id: str | None

    def covers(self, run_id: str) -> bool:
        return self.run_id is None or self.run_id == run_id

    @property
    def outlives_runs(self) -> bool:
        """Whether it may decide what lasts beyond one run (an *always* answer): the global token only."""
        return self.run_id is None

    @property
    def auth(self) -> str:
        """The credential, as the audit log's ``approval.decided`` names it (never the caller's own words)."""
        return "global token" if self.run_id is None else f"run token of {self.run_id}"


SCOPE = web.RequestKey("scope", Scope)
# The approval routes a run's own token may use (their handlers narrow them to its run).
RUN_SCOPED_ROUTES = frozenset(
    {("GET", "/approvals"), ("POST", "/approvals/{approval_id}/allow"), ("POST", "/approvals/{approval_id}/deny")}
)


def describe(approval: PendingApproval) -> dict[str, Any]:
    """An approval as JSON: the request, the rendered message, the times, whether its clients gave up."""
    return approval.fields() | {"created_at": rfc3339(approval.created_at), "abandoned": approval.abandoned}


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _answered(approval_id: str, answered: Answered, scope: ApprovalScope, by: str) -> web.Response:
    """What became of an answer, as the control API says it."""
    if answered.result is AnswerResult.NOT_OFFERED:
        why = ": egressd has no allow file (--allow-file)" if scope is ApprovalScope.ALWAYS else ""
        return _error(400, f"scope {scope.value} is not offered for approval {approval_id}{why}")
    if answered.result is AnswerResult.UNKNOWN:
        return _error(404, f"no pending approval {approval_id}")
    if answered.result is AnswerResult.SETTLED:
        how = settled_text(answered.settlement) if answered.settlement else "settled"
        return _error(409, f"approval {approval_id} was already settled: {how}")
    if answered.result is AnswerResult.NOT_APPLIED:
        return _error(503, f"approval {approval_id} is held by another instance of the fleet, which did not take "
                           "the answer in time: nothing was decided; answer again")
    settlement = answered.settlement
    return web.json_response(
        {
            "id": approval_id,
            "decision": Decision.ALLOW if settlement is None or settlement.reason is None else Decision.DENY,
            "by": settlement.by if settlement else by,
            "scope": settlement.scope.value if settlement and settlement.scope else None,
            "entry": settlement.entry if settlement else None,
            "scope_error": settlement.scope_error if settlement else None,
        }
    )


def control_routes(answerer: Answerer, elsewhere: Elsewhere | None = None) -> list[Route]:
    """The three routes of the module docstring, bound to ``answerer``; with ``elsewhere`` (a fleet), the
    approvals other instances hold are listed too, and an answer to one is passed to its holder."""

    async def list_pending(request: web.Request) -> web.Response:
        scope = request[SCOPE]
        listed = [describe(a) for a in answerer.pending() if scope.covers(a.request.run_id)]
        if elsewhere is not None:
            # As this instance lists its own (the page's card and the Slack message are the page's and the relay's).
            listed += [{k: v for k, v in listing.items() if k not in ("page", "slack")}
                       for run, listing in await elsewhere.listed() if scope.covers(run)]  # fmt: skip
        return web.json_response({"approvals": listed})

    async def decide(request: web.Request, decision: Choice) -> web.Response:
        approval_id = request.match_info["approval_id"]
        by = DEFAULT_BY
        scope = ApprovalScope.RUN
        raw = await request.content.read(MAX_BODY_BYTES + 1)
        if len(raw) > MAX_BODY_BYTES:
            return _error(413, "body too large")
        if raw.strip():
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                return _error(400, "body is not JSON")
            if not isinstance(body, dict):
                return _error(400, "body must be a JSON object")
            given = body.get("by", DEFAULT_BY)
            if not isinstance(given, str) or not given.strip():
                return _error(400, "by must be a non-empty string")
            by = given.strip()
            if decision is Choice.ALLOW and "scope" in body:
                chosen = parse_scope(body["scope"])
                if chosen is None:
                    return _error(400, "scope must be once, run or always")
                scope = chosen
        reach = request[SCOPE]
        if decision is Choice.ALLOW and scope is ApprovalScope.ALWAYS and not reach.outlives_runs:
            return _error(403, f"scope always outlives run {reach.run_id}: it needs the global control token")
        if elsewhere is not None and approval_id not in {a.id for a in answerer.pending()}:
            try:
                run = await elsewhere.run_of(approval_id)
                if run is not None:  # another instance holds it: it decides, this one passes the answer on
                    if not reach.covers(run):
                        return _error(403, f"approval {approval_id} is not of run {reach.run_id}: "
                                           "this token acts on its own run only")
                    passed = await elsewhere.answer(approval_id, decision, channel=CHANNEL, by=by, scope=scope,
                                                    auth=reach.auth)  # fmt: skip
                    return _answered(approval_id, passed, scope, by)
            except ChannelError as exc:
                return _error(503, f"approval {approval_id}: {exc}")
        if reach.run_id is not None:
            # Checked after the body is read, with no await until answer(): nothing is settled in between.
            runs = {a.id: a.request.run_id for a in answerer.pending()}
            if approval_id not in runs:
                return _error(404, f"no pending approval {approval_id} of run {reach.run_id}")
            if runs[approval_id] != reach.run_id:
                return _error(403, f"approval {approval_id} is not of run {reach.run_id}: "
                                   "this token acts on its own run only")
        answered = answerer.answer(approval_id, decision, channel=CHANNEL, by=by, scope=scope, auth=reach.auth)
        return _answered(approval_id, answered, scope, by)

    async def allow(request: web.Request) -> web.Response:
        return await decide(request, Choice.ALLOW)

    async def deny(request: web.Request) -> web.Response:
        return await decide(request, Choice.DENY)

    routes: Sequence[Route] = (
        Route("GET", "/approvals", list_pending),
        Route("POST", "/approvals/{approval_id}/allow", allow),
        Route("POST", "/approvals/{approval_id}/deny", deny),
    )
    return list(routes)

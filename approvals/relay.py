"""``--approver terminal`` for an egressd that has no terminal (in a container): its approvals, our terminal.

egressd's webhook channel (``egressd.approvals.webhook``) delivers each approval,
signed, to ``TerminalRelay``'s listener; a ``TerminalChannel`` prompt shows it on the
terminal where the run was started; the answer goes back through egressd's control
API (``ControlApi``: cli's ``ControlClient`` with its bearer token). ``egressd run
--backend docker`` starts one (``egressd.cli.wiring.docker_session``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import json
import secrets
import sys
import time
from typing import Any, Protocol

from aiohttp import web

from egressd.approvals.commandoutput import TerminalOutput
from egressd.approvals.interface import (
    Answered,
    AnswerResult,
    ApprovalRequest,
    ApprovalScope,
    ChannelError,
    ChannelUnavailable,
    Choice,
    PendingApproval,
    Settlement,
    parse_scope,
)
from egressd.approvals.message import render
from egressd.approvals.signing import ReplayGuard, VerifyError, verify
from egressd.approvals.terminal import TerminalChannel
from egressd.vocabulary.reasons import ANSWER_REASONS, Answer


class ControlApi(Protocol):
    """What the relay needs of egressd's control API: one call with its bearer token."""

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        """The JSON body of a successful call; raises for a refusal."""
        ...


def _epoch(text: Any, default: float) -> float:
    try:
        return dt.datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return default


class TerminalRelay:
    """``--approver terminal`` for egressd in a container: its approvals, our terminal.

    egressd's webhook channel delivers each ``approval.requested`` here
    (signed with a key made for this run; anything unsigned, stale or
    replayed is refused); the approval is shown by an ``egressd.approvals.terminal``
    prompt, whose answer this relay — the prompt's ``Answerer`` — sends to
    the control API. ``approval.settled`` withdraws a prompt answered
    elsewhere or expired.

    The webhook goes over plain http to the Docker gateway, which is no
    loopback address, so the sidecar gets ``unsafe_webhook_http``. What
    that risks is contained: the requests are signed (we check them), this
    relay answers only 202 and sends every answer through the control API
    with its bearer token, and with that setting egressd ignores any answer
    in a webhook response, so nothing on the bridge can answer by forging one.
    """

    def __init__(self, *, address: str, tty_path: str = "/dev/tty", output: TerminalOutput | None = None) -> None:
        self.address = address
        self.key = secrets.token_bytes(32)
        self.secret = "whsec_" + base64.b64encode(self.key).decode()
        self.terminal = TerminalChannel(tty_path=tty_path, output=output)
        self.control: ControlApi | None = None  # set once the run is registered
        # Answering with the run's own token: *always* outlives the run, which that token may not decide (403).
        self.run_scoped = False
        self.url = ""
        self._pending: dict[str, PendingApproval] = {}
        self._answers: asyncio.Queue[tuple[str, Choice, str | None, ApprovalScope]] = asyncio.Queue()
        self._guard = ReplayGuard()
        self._runner: web.AppRunner | None = None
        self._sender: asyncio.Task[None] | None = None

    async def start(self) -> bool:
        """Open the terminal and listen; False when there is no terminal (the channel is not attached)."""
        try:
            await self.terminal.start(self)
        except ChannelUnavailable:
            return False
        app = web.Application(client_max_size=64 * 1024)
        app.router.add_post("/approvals", self._hook)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.address, 0).start()
        self.url = f"http://{self.address}:{self._runner.addresses[0][1]}/approvals"
        self._sender = asyncio.ensure_future(self._send_answers())
        return True

    async def close(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sender
        if self._runner is not None:
            await self._runner.cleanup()
        await self.terminal.close()

    # -- the Answerer the prompt answers through ------------------------------------------

    def answer(
        self, approval_id: str, decision: Choice, *, channel: str, by: str | None,
        scope: ApprovalScope = ApprovalScope.RUN, auth: str | None = None,
    ) -> Answered:
        # ``auth`` is egressd's to record: the answer goes on through the control API, which names our token.
        pending = self._pending.get(approval_id)
        if pending is None:
            return Answered(AnswerResult.UNKNOWN)
        if decision is Choice.ALLOW and not pending.offers(scope):
            return Answered(AnswerResult.NOT_OFFERED)
        del self._pending[approval_id]
        self._answers.put_nowait((approval_id, decision, by, scope))
        return Answered(AnswerResult.ACCEPTED)

    def pending(self) -> list[PendingApproval]:
        return list(self._pending.values())

    async def _send_answers(self) -> None:
        while True:
            approval_id, decision, by, scope = await self._answers.get()
            if self.control is None:
                continue
            body = {"by": by or "terminal"}
            if decision is Choice.ALLOW:
                body["scope"] = scope.value
            try:
                await self.control.call("POST", f"/approvals/{approval_id}/{decision.value}", body)
            except Exception as exc:  # a task boundary: settled meanwhile, or egressd gone (the request fails closed)
                print(f"egressd: the answer to {approval_id} was not taken: {exc}", file=sys.stderr)

    # -- what egressd's webhook channel sends ------------------------------------------------

    async def _hook(self, request: web.Request) -> web.Response:
        body = await request.read()
        now = time.time()
        try:
            msg_id = verify(self.key, request.headers, body, now=now)
        except VerifyError:
            return web.Response(status=401)
        if not self._guard.first_sighting(msg_id, now=now):
            return web.Response(status=409)
        try:
            payload = json.loads(body)
            kind, approval_id = payload["type"], str(payload["id"])
        except (ValueError, KeyError, TypeError):
            return web.Response(status=400)
        try:
            if kind == "approval.requested":
                await self._requested(approval_id, payload, now)
            elif kind == "approval.settled":
                await self._settled(approval_id, payload, now)
        except ChannelError:
            return web.Response(status=503)  # the terminal is gone: nobody here answers
        return web.Response(status=202)

    async def _requested(self, approval_id: str, payload: dict[str, Any], now: float) -> None:
        if approval_id in self._pending:
            return  # a retry of what is on screen already
        host, port = str(payload.get("host")), int(payload.get("port") or 0)
        command, task = payload.get("command"), payload.get("task")
        allowed = tuple(str(a) for a in payload.get("allowed") or ())
        expires = _epoch(payload.get("expires_at"), now + 600)
        approval = PendingApproval(
            id=approval_id,
            request=ApprovalRequest(run_id=str(payload.get("run")), host=host, port=port, command=command,
                                    task=task, allowed=allowed),
            message=render(host=host, port=port, command=command, task=task, allowed=allowed),
            created_at=now,
            expires_at=expires,
            deadline=asyncio.get_running_loop().time() + max(0.0, expires - now),
            scopes=tuple(
                s for s in map(parse_scope, payload.get("scopes") or ("once", "run"))
                if s is not None and not (self.run_scoped and s is ApprovalScope.ALWAYS)
            ),
        )
        self._pending[approval_id] = approval
        await self.terminal.deliver(approval)

    async def _settled(self, approval_id: str, payload: dict[str, Any], now: float) -> None:
        approval = self._pending.pop(approval_id, None)
        if approval is None:
            return
        reasons = {reason.value: answer for answer, reason in ANSWER_REASONS.items()}
        answer = Answer.ALLOW if payload.get("reason") is None else reasons.get(str(payload["reason"]), Answer.DENY)
        at = _epoch(payload.get("at"), now)
        entry = payload.get("entry")
        settlement = Settlement(answer=answer, channel=payload.get("channel"), by=payload.get("by"), at=at,
                                waited_s=max(0.0, at - approval.created_at), scope=parse_scope(payload.get("scope")),
                                entry=entry if isinstance(entry, str) else None)
        await self.terminal.settle(approval, settlement)


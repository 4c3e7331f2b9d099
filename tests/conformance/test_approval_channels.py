"""The approval channels' contract (DESIGN.md, "The new-domain approval message"), held against every channel.

Each check runs once per way a person answers an approval, under a real
``ApprovalBroker``, through the channel's real transport:

- ``terminal``  ``TerminalChannel`` on a pseudo-terminal: the check reads the
  screen and types the answer;
- ``slack``     ``SlackChannel`` against ``FakeSlack`` (Web API and Socket
  Mode on loopback): the check reads the posted blocks and clicks a button;
- ``webhook``   ``WebhookChannel`` posting to a ``WebhookReceiver`` on
  loopback: the check reads the signed POST and answers by the signed
  callback, served as the control server serves it;
- ``web``       ``WebChannel``, the approvals page, served as the control server
  serves it: a browser's requests (a session cookie, the CSRF token, an
  ``Origin``) read the page's HTML and its event stream and post the
  Allow/Deny form;
- ``control``   the control API's ``/approvals`` routes through egressd's own
  control client (what ``egressd pending|allow|deny`` use), behind a
  bearer-token check on loopback, answering approvals a silent channel holds;
- ``fleet``     a fleet on a real PostgreSQL (``serve --state``): the
  approval is held by an instance whose one channel is the fleet, and
  answered through another instance's control API; the holder decides
  (recorded as ``control@answerer-instance``);
- ``fleet-web`` the same, answered on the approvals page another instance
  serves (recorded as ``web@answerer-instance``);
- ``nobody``    no channel attached (a terminal configured, none there): the
  request is refused at once as ``no_approver``, no approval is opened, and
  ``egressd allow|deny`` finds nothing to answer.

A ``Driver`` knows only how a person sees and answers its channel; the
checks are the same for all. What one channel does and another does not is
a failure here, whatever the channel's own tests say. Where a check cannot
be put to a channel at all, it is not generated for it (``drivers``, no
skips): the terminal's answer names no approval (no unknown id to type);
the control API and nobody are no channel that could go away (the fleet's
database going away is the fleet tests' outage test); nobody is
itself the never-attached case. Only Slack, the page (signed in with a
run's own token), the control API and the fleet bind an answer to one run, so only
they are handed another run's approval to answer.
"""

from __future__ import annotations

import asyncio
import html
import json
import re
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import pytest

from egressd.approvals.broker import ApprovalBroker
from egressd.approvals.control import Scope
from egressd.approvals.fleetchannel import FleetChannel
from egressd.approvals.interface import ApprovalOutcome, ApprovalRequest, ApprovalScope, Channel, Choice, SetupError
from egressd.approvals.message import UNRELATED, is_invisible, render
from egressd.approvals.prompt import BOLD, CLEAR_LINE, RESET, SANE, WARN
from egressd.approvals.signing import parse_secret
from egressd.approvals.slack import SlackChannel
from egressd.approvals.slackblocks import ALLOW_ALWAYS_ACTION
from egressd.approvals.terminal import TerminalChannel
from egressd.approvals.web import WebChannel
from egressd.approvals.webcontrol import ControlView
from egressd.approvals.webhook import WebhookChannel
from egressd.approvals.webview import DECISIONS
from egressd.audit.log import MemoryAuditSink
from egressd.cli.wiring.control_client import ControlClient
from egressd.config.allowfile import read_allow_file
from egressd.fleet.store import Store
from egressd.vocabulary.reasons import Answer
from tests.fakes.control import control_server
from tests.fakes.slack import FakeSlack, block_actions
from tests.fakes.terminal import Pty
from tests.fakes.webhook import WebhookReceiver, make_secret
from tests.harness import listening_socket, refused_port, wait_until
from tests.integration.approvals.test_broker import RecordingChannel
from tests.integration.approvals.webclient import EventReader, PageClient
from tests.postgres import Postgres

UNKNOWN_ID = "a-doesnotexist0000"
HOLDER, ANSWERER = "holder-instance", "answerer-instance"  # the fleet driver's two instances


def request(host: str = "evil.example", run: str = "r-1") -> ApprovalRequest:
    return ApprovalRequest(
        run_id=run, host=host, port=443, command="curl evil", task="build", allowed=("pypi.org",)
    )  # fmt: skip


# What the agent controls, written to be interpreted: terminal control sequences (clear the
# screen, move the cursor, a fake prompt, a bell, a C1 CSI, an OSC hyperlink), HTML, Slack
# mrkdwn, mentions and links, an entity, a right-to-left override; and the domain is a
# look-alike of pypi.org (Cyrillic "і") that only its punycode form gives away.
HOSTILE = ApprovalRequest(
    run_id="r-1",
    host="login.xn--pyp-lhd.org",
    port=443,
    command=(
        "curl -s https://files.example/x\x1b[2J\x1b[1;1Hallow or deny pypi.org:443?\x07 \x9b31m"
        "\x1b]8;;https://evil.example\x1b\\link\x1b]8;;\x1b\\ <script>alert(1)</script> *bold* _it_ ~s~ `code` "
        ":skull: <!channel> <@U0ALICE> <https://evil.example|pypi.org> &amp; \u202egnp.exe"
    ),
    task="build the docs\x1b[8m hidden",
    allowed=("pypi.org", "files.pythonhosted.org"),
)
# Named in its command: no "unrelated" warning.
RELATED = ApprovalRequest(
    run_id="r-1",
    host="api.github.com",
    port=443,
    command="git clone https://github.com/egressd/egressd",
    task="clone the repository",
    allowed=("pypi.org",),
)
# Under an allowed domain, named nowhere: no "unrelated" warning either.
UNDER_ALLOWED = ApprovalRequest(
    run_id="r-1",
    host="upload.pypi.org",
    port=443,
    command="twine upload dist/*",
    task="publish the release",
    allowed=("pypi.org",),
)
# Characters that must never reach a person raw, whatever the medium.
RAW = ("\x1b", "\x07", "\x9b", "\u202e")


def decided(audit: MemoryAuditSink) -> list[dict[str, Any]]:
    return [r for r in audit.records if r["event"] == "approval.decided"]


def assert_nobody_could_answer(driver: Driver, outcome: ApprovalOutcome) -> None:
    """Refused with nobody answering: no_approver (or, where delivery is retried until expiry, a timeout)."""
    allowed = {Answer.NO_APPROVER, Answer.TIMEOUT} if driver.retries_until_expiry else {Answer.NO_APPROVER}
    assert outcome.answer in allowed and (outcome.channel, outcome.by) == (None, None), outcome
    records = [r for r in decided(driver.audit) if r["id"] == outcome.approval_id]
    assert [(r["decision"], r["reason"], r["channel"], r["by"]) for r in records] == (
        [("deny", "no_approver" if outcome.answer is Answer.NO_APPROVER else "approval_timeout", None, None)]
        if outcome.approval_id is not None
        else []
    )


async def opened(broker: ApprovalBroker, host: str = "evil.example") -> str:
    """The id of the approval the broker holds for ``host`` (``Answerer.pending``)."""
    await wait_until(lambda: any(a.request.host == host for a in broker.pending()))
    return next(a.id for a in broker.pending() if a.request.host == host)


async def hold(driver: Driver, broker: ApprovalBroker, req: ApprovalRequest | None = None,
               ) -> tuple[asyncio.Task[ApprovalOutcome], str] | None:  # fmt: skip
    """Ask; once the approval is in front of a person, the waiting request and the approval's id.

    Nobody attached: the request is refused at once as ``no_approver``, no
    approval is opened (nothing recorded, nothing listed), and an answer
    through the control API finds nothing to answer; then None, and the
    check has nothing more to put to it.
    """
    req = req or request()
    if not driver.attached:
        outcome = await asyncio.wait_for(broker.ask(req), 5)
        assert outcome == ApprovalOutcome(Answer.NO_APPROVER), outcome  # no id, nobody, no wait
        assert broker.pending() == [] and driver.audit.records == []
        assert await driver.answer_unknown("", Choice.ALLOW) is False
        return None
    held = asyncio.create_task(broker.ask(req))
    approval_id = await opened(broker, req.host)
    await driver.shown(approval_id)
    return held, approval_id


async def poll(check: Callable[[], Any], timeout_s: float = 5.0) -> Any:
    """Await ``check()`` until it returns something true; return it."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not (found := await check()):
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)
    return found


# -- the drivers -----------------------------------------------------------------------------


class Driver:
    """How a person sees and answers approvals on one channel; the checks use nothing else.

    ``answer`` and friends return True when the channel says the answer
    counted, False when it says it was refused, None when it says nothing
    (the terminal, typed into with no prompt shown).
    """

    channel: ClassVar[str]  # the name outcomes and audit records carry
    by: ClassVar[str]  # who this driver answers as, as recorded
    marks: ClassVar[dict[str, str]]  # what the channel shows once an approval is allowed, denied, expired
    names_approvals: ClassVar[bool] = True  # an answer names its approval (else: the prompt on screen)
    run_scoped: ClassVar[bool] = False  # an answer is bound to one run's approval (``answer_foreign``)
    goes_away: ClassVar[str | None] = None  # why ``detach`` cannot apply, when it cannot
    attached: ClassVar[bool] = True  # False: nobody is there to be shown anything (``hold``)
    # Delivery is retried until the approval expires (the webhook, DESIGN.md): a receiver never
    # reached fails for certain (no_approver) only just before the deadline, or the deadline
    # passes with an attempt in flight (approval_timeout). Either way nobody answered.
    retries_until_expiry: ClassVar[bool] = False

    def __init__(self, stack: AsyncExitStack, tmp_path: Path) -> None:
        self.stack = stack
        self.tmp_path = tmp_path
        self.audit = MemoryAuditSink()
        # Where *always* answers go (--allow-file); None: *always* is not offered. Set before ``start``.
        self.allow_file: Path | None = None

    async def broker(self, channels: Sequence[Channel], timeout_s: float) -> ApprovalBroker:
        broker = ApprovalBroker(list(channels), audit=self.audit, timeout_s=timeout_s, allow_file=self.allow_file)
        self.stack.push_async_callback(broker.close)
        await broker.start()
        return broker

    async def start(self, timeout_s: float) -> ApprovalBroker:
        raise NotImplementedError

    async def shown(self, approval_id: str) -> str:
        """Wait until the approval is in front of a person; the text they read (the medium's markup undone)."""
        raise NotImplementedError

    def inert(self) -> None:
        """Assert that nothing sent so far could be read by the medium as anything but text."""
        raise NotImplementedError

    async def answer(self, approval_id: str, choice: Choice) -> bool | None:
        raise NotImplementedError

    async def withdrawn(self, approval_id: str) -> str:
        """Wait until the channel shows the approval as settled; what it shows then."""
        raise NotImplementedError

    async def detach(self) -> None:
        """The person's side goes away (the terminal hangs up, Slack or the receiver is gone)."""
        raise NotImplementedError

    async def never_attached(self) -> ApprovalBroker:
        """A started broker whose channel has nothing to attach to, or SetupError (start-up stops)."""
        raise NotImplementedError

    async def answer_unknown(self, pending_id: str, choice: Choice) -> bool | None:
        """Answer an approval id that does not exist, the way the channel lets one name it."""
        raise NotImplementedError

    async def answer_foreign(self, own_id: str, other_id: str, choice: Choice) -> bool | None:
        """Answer ``other_id`` (another run's) through what the channel gave for ``own_id``."""
        raise NotImplementedError

    async def offered(self, approval_id: str) -> set[str]:
        """The scopes the channel offers a person for this shown approval (``once``, ``run``, ``always``)."""
        raise NotImplementedError

    async def answer_scoped(self, approval_id: str, scope: ApprovalScope) -> bool | None:
        """Allow with ``scope``, the way the channel lets one ask for it, also when it does not offer it
        (a tampered button, a hand-written callback); True when it counted, False when refused."""
        raise NotImplementedError


# Every sequence the terminal channel writes of its own; anything else that is not text came from elsewhere.
_TERMINAL_OWN = (CLEAR_LINE, SANE, BOLD, WARN, RESET)
_COUNTDOWN_MOVE = re.compile(r"\x1b\[\d+[DC]")


def terminal_text(output: str) -> str:
    """What a person reads on the terminal: egressd's own sequences removed, line ends as newlines."""
    for sequence in _TERMINAL_OWN:
        output = output.replace(sequence, "")
    return re.sub(r"\r+\n", "\n", _COUNTDOWN_MOVE.sub("", output))  # the pty's ONLCR makes "\r\n" "\r\r\n"


class TerminalDriver(Driver):
    channel = "terminal"
    by = "alice"
    marks: ClassVar[dict[str, str]] = {
        "allow": "allowed for this run",
        "deny": "denied for this run",
        "timeout": "expired (denied)",
    }
    names_approvals = False

    async def start(self, timeout_s: float) -> ApprovalBroker:
        self.pty = Pty()
        self.stack.callback(self.pty.close)
        return await self.broker([TerminalChannel(tty_path=self.pty.path, who="alice")], timeout_s)

    def _on_screen(self, approval_id: str) -> bool:
        """The approval's prompt is the one shown: its header is the last, and its input line is live."""
        output = self.pty.output
        at = output.rfind("egressd: approval ")
        live = output[output.rfind("\r\n") + 2 :]
        return at >= 0 and output.startswith(f"egressd: approval {approval_id} ", at) and "Enter = deny]" in live

    async def shown(self, approval_id: str) -> str:
        await wait_until(lambda: self._on_screen(approval_id))
        output = self.pty.output
        return terminal_text(output[output.rfind(f"egressd: approval {approval_id} ") :])

    def inert(self) -> None:
        text = terminal_text(self.pty.output)
        assert not [ch for ch in text if ch != "\n" and (ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0)], repr(text)

    async def answer(self, approval_id: str, choice: Choice) -> bool | None:
        word = "allow" if choice is Choice.ALLOW else "deny"
        mark = len(self.pty.output)
        if not self._on_screen(approval_id):
            self.pty.type(word + "\r")  # typed with no prompt for it: nothing should come of it
            await asyncio.sleep(0.3)
            return None
        self.pty.type(word + "\r")
        said = await self._outcome(mark)
        return said.endswith("for this run")  # else "already settled: …" or "no longer pending"

    async def _outcome(self, mark: int) -> str:
        """The line that says how the answer typed after ``mark`` ended (the input line, ended, comes first)."""

        def lines() -> list[str]:
            return [ln for ln in terminal_text(self.pty.output[mark:]).split("\n") if "Enter = deny]" not in ln]

        await wait_until(lambda: any(ln.strip() for ln in lines()[:-1]))  # a whole line after the input line
        return next(ln for ln in lines() if ln.strip())

    async def offered(self, approval_id: str) -> set[str]:
        [line] = [ln for ln in (await self.shown(approval_id)).split("\n") if ln.startswith("Answer ")]
        words = {"once": "once", "allow": "run", "always": "always"}
        return {scope for word, scope in words.items() if re.search(rf"\b{word} \(", line)}

    async def answer_scoped(self, approval_id: str, scope: ApprovalScope) -> bool | None:
        word = {ApprovalScope.ONCE: "once", ApprovalScope.RUN: "allow", ApprovalScope.ALWAYS: "always"}[scope]
        assert self._on_screen(approval_id)
        mark = len(self.pty.output)
        self.pty.type(word + "\r")
        await wait_until(lambda: "\r\n" in self.pty.output[mark:] or "type allow or deny" in self.pty.output[mark:])
        if "\r\n" not in self.pty.output[mark:]:
            return False  # not an answer here: the prompt asks again
        said = await self._outcome(mark)
        return said.endswith(("for this run", "the next one asks again)", "added to the allow file"))

    async def withdrawn(self, approval_id: str) -> str:
        header = f"egressd: approval {approval_id} "
        await wait_until(lambda: header in self.pty.output and not self._on_screen(approval_id))
        return terminal_text(self.pty.output[self.pty.output.rfind(header) :])

    async def detach(self) -> None:
        self.pty.hang_up()
        # The channel reads the prompt's input: the next select sees the hang-up, before this timer.
        await asyncio.sleep(0.05)

    async def never_attached(self) -> ApprovalBroker:
        return await self.broker([TerminalChannel(tty_path=str(self.tmp_path / "no-such-tty"))], 30.0)


ALICE = "U0ALICE"


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


_SLACK_ENTITY = re.compile(r"&(amp|lt|gt);")


def slack_text(blocks: Any) -> str:
    """What a person reads in a Slack message: every text object, Slack's three entities undone."""
    texts: list[str] = []
    for block in _json(blocks):
        if "text" in block:
            texts.append(block["text"]["text"])
        for element in block.get("elements") or []:
            texts.append(element["text"]["text"] if element.get("type") == "button" else element["text"])
    entities = {"amp": "&", "lt": "<", "gt": ">"}
    return "\n".join(_SLACK_ENTITY.sub(lambda m: entities[m.group(1)], text) for text in texts)


class SlackDriver(Driver):
    channel = "slack"
    by = f"@alice ({ALICE})"
    marks: ClassVar[dict[str, str]] = {
        "allow": f"*Allowed* by <@{ALICE}>",
        "deny": f"*Denied* by <@{ALICE}>",
        "timeout": "*Expired — denied*",
    }
    run_scoped = True  # a click counts only from the message posted for its approval

    async def start(self, timeout_s: float) -> ApprovalBroker:
        self.slack = await self.stack.enter_async_context(FakeSlack())
        return await self.broker([self._channel()], timeout_s)

    def _channel(self, bot_token: str | None = None) -> SlackChannel:
        return SlackChannel(
            bot_token=bot_token or self.slack.bot_token,
            channel="C0APPROVE",
            approvers=[ALICE],
            app_token=self.slack.app_token,
            api_url=self.slack.api_url,
            retry_backoff_s=0.01,
        )

    def _post(self, approval_id: str) -> dict[str, Any] | None:
        for post in self.slack.posted:
            for block in _json(post["blocks"]):
                if any(str(e.get("value", "")).endswith(":" + approval_id) for e in block.get("elements") or []):
                    return post
        return None

    def _updates(self, approval_id: str) -> list[dict[str, Any]]:
        post = self._post(approval_id)
        return [u for u in self.slack.called("chat.update") if post is not None and u["ts"] == post["ts"]]

    async def shown(self, approval_id: str) -> str:
        await wait_until(lambda: self._post(approval_id) is not None)
        post = self._post(approval_id)
        assert post is not None
        return slack_text(post["blocks"])

    def inert(self) -> None:
        for args in self.slack.posted + self.slack.called("chat.update"):
            for block in _json(args["blocks"]):
                objects = [block["text"]] if "text" in block else []
                objects += [e for e in block.get("elements") or [] if e.get("type") in ("plain_text", "mrkdwn")]
                for obj in objects:
                    text = obj["text"]
                    # Slack reads "<…>" as a link, mention or date: only egressd's own are there.
                    assert re.sub(r"<!date\^[^<>]*>|<@U0ALICE>", "", text).count("<") == 0, text
                    if obj["type"] == "mrkdwn":  # egressd's own words: none of the agent's text is ever markup
                        assert "alert(1)" not in text and "bold" not in text and "skull" not in text, text

    async def _interact(self, approval_id: str, payload: dict[str, Any]) -> bool:
        told = len(self.slack.called("chat.postEphemeral"))
        updated = len(self._updates(approval_id))
        await self.slack.interact(payload)
        await wait_until(
            lambda: len(self.slack.called("chat.postEphemeral")) > told or len(self._updates(approval_id)) > updated
        )
        return len(self.slack.called("chat.postEphemeral")) == told

    async def answer(self, approval_id: str, choice: Choice) -> bool | None:
        post = self._post(approval_id)
        assert post is not None
        return await self._interact(approval_id, block_actions(post, choice.value, user=ALICE, username="alice"))

    async def withdrawn(self, approval_id: str) -> str:
        def settled() -> list[dict[str, Any]]:
            return [u for u in self._updates(approval_id) if all(b["type"] != "actions" for b in _json(u["blocks"]))]

        await wait_until(settled)
        return json.dumps(_json(settled()[-1]["blocks"]), ensure_ascii=False)

    async def detach(self) -> None:
        self.slack.down = True

    async def never_attached(self) -> ApprovalBroker:
        self.slack = await self.stack.enter_async_context(FakeSlack())
        return await self.broker([self._channel(bot_token="xoxb-revoked")], 30.0)

    def _naming(self, via_id: str, target_id: str, choice: Choice) -> dict[str, Any]:
        """A click on the message of ``via_id`` whose button names ``target_id`` instead."""
        post = self._post(via_id)
        assert post is not None
        payload = block_actions(post, choice.value, user=ALICE, username="alice")
        instance = payload["actions"][0]["value"].partition(":")[0]
        payload["actions"][0]["value"] = f"{instance}:{target_id}"
        return payload

    async def answer_unknown(self, pending_id: str, choice: Choice) -> bool | None:
        return await self._interact(pending_id, self._naming(pending_id, UNKNOWN_ID, choice))

    _SCOPE_ACTIONS: ClassVar[dict[str, str]] = {
        "egressd_allow_once": "once",
        "egressd_allow": "run",
        "egressd_allow_always": "always",
    }

    async def offered(self, approval_id: str) -> set[str]:
        await self.shown(approval_id)
        post = self._post(approval_id)
        assert post is not None
        ids = {e["action_id"] for b in _json(post["blocks"]) if b["type"] == "actions" for e in b["elements"]}
        return {scope for action, scope in self._SCOPE_ACTIONS.items() if action in ids}

    async def answer_scoped(self, approval_id: str, scope: ApprovalScope) -> bool | None:
        post = self._post(approval_id)
        assert post is not None
        suffix = {ApprovalScope.ONCE: "once", ApprovalScope.RUN: "allow", ApprovalScope.ALWAYS: "always"}[scope]
        if scope.value in await self.offered(approval_id):
            payload = block_actions(post, suffix, user=ALICE, username="alice")
        else:
            # No such button: the click is tampered into one (the Allow button's action id rewritten).
            payload = block_actions(post, "allow", user=ALICE, username="alice")
            payload["actions"][0]["action_id"] = ALLOW_ALWAYS_ACTION
        return await self._interact(approval_id, payload)

    async def answer_foreign(self, own_id: str, other_id: str, choice: Choice) -> bool | None:
        return await self._interact(own_id, self._naming(own_id, other_id, choice))


class WebhookDriver(Driver):
    channel = "webhook"
    by = "bob"
    retries_until_expiry = True
    marks: ClassVar[dict[str, str]] = {
        "allow": '"decision": "allow", "reason": null, "channel": "webhook", "by": "bob"',
        "deny": '"decision": "deny", "reason": "denied", "channel": "webhook", "by": "bob"',
        "timeout": '"decision": "deny", "reason": "approval_timeout", "channel": null',
    }

    async def start(self, timeout_s: float) -> ApprovalBroker:
        secret, key = make_secret()
        _, callback_key = make_secret()
        self.receiver = WebhookReceiver(key, callback_key=callback_key, mode="later")
        await self.receiver.__aenter__()
        self.gone = False
        self.stack.push_async_callback(self._close_receiver)
        return await self._broker(self.receiver.url, parse_secret(secret), callback_key, timeout_s)

    async def _close_receiver(self) -> None:
        if not self.gone:
            self.gone = True
            await self.receiver.__aexit__(None, None, None)

    async def _broker(self, url: str, key: bytes, callback_key: bytes, timeout_s: float) -> ApprovalBroker:
        sock = listening_socket()  # bound before its port is named in public_url
        channel = WebhookChannel(
            url=url,
            secret=key,
            callback_secret=callback_key,
            public_url=f"http://127.0.0.1:{sock.getsockname()[1]}/",
            backoff_first_s=0.02,
            backoff_max_s=0.05,
        )
        broker = await self.broker([channel], timeout_s)
        await self.stack.enter_async_context(control_server(broker.routes, sock))
        return broker

    def _delivery(self, approval_id: str) -> dict[str, Any] | None:
        return next((r.payload for r in self.receiver.requests if r.payload["id"] == approval_id), None)

    async def shown(self, approval_id: str) -> str:
        await wait_until(lambda: self._delivery(approval_id) is not None)
        payload = self._delivery(approval_id)
        assert payload is not None
        return str(payload["message"])

    def inert(self) -> None:
        for received in self.receiver.received:
            assert received.signature_ok
            assert not [b for b in received.body if b < 0x20], received.body  # JSON escapes every control character

    async def answer(self, approval_id: str, choice: Choice) -> bool | None:
        url = next(r.payload["callback_url"] for r in self.receiver.requests)
        status, _, _ = await self.receiver.callback(approval_id, choice.value, by="bob", url=url)
        assert status in (200, 404, 409), status
        return status == 200

    async def withdrawn(self, approval_id: str) -> str:
        await wait_until(lambda: any(r.payload["id"] == approval_id for r in self.receiver.settled))
        return json.dumps(next(r.payload for r in self.receiver.settled if r.payload["id"] == approval_id))

    async def detach(self) -> None:
        await self._close_receiver()

    async def never_attached(self) -> ApprovalBroker:
        port = self.stack.enter_context(refused_port())
        secret, _ = make_secret()
        _, callback_key = make_secret()
        return await self._broker(f"http://127.0.0.1:{port}/hook", parse_secret(secret), callback_key, 1.0)

    async def answer_unknown(self, pending_id: str, choice: Choice) -> bool | None:
        return await self.answer(UNKNOWN_ID, choice)

    async def offered(self, approval_id: str) -> set[str]:
        await self.shown(approval_id)
        payload = self._delivery(approval_id)
        assert payload is not None
        return set(payload["scopes"])

    async def answer_scoped(self, approval_id: str, scope: ApprovalScope) -> bool | None:
        url = next(r.payload["callback_url"] for r in self.receiver.requests)
        status, _, _ = await self.receiver.callback(approval_id, "allow", by="bob", url=url, scope=scope.value)
        assert status in (200, 422), status
        return status == 200


class PageDriver(Driver):
    """The approvals page, as a browser uses it: signed in, the page open (its event stream), the form posted."""

    channel = "web"
    by = "alice"
    marks: ClassVar[dict[str, str]] = {
        "allow": "allowed by alice via web",
        "deny": "denied by alice via web",
        "timeout": "expired (denied)",
    }
    run_scoped = True  # a session signed in with a run's own token answers that run's approvals only
    TOKENS: ClassVar[dict[str, Scope]] = {
        "global-token": Scope(None),
        "r-1-token": Scope("r-1"),
        "r-2-token": Scope("r-2"),
    }
    # The page's own tags; anything else in its HTML came from elsewhere.
    OWN_TAGS = frozenset({"li", "div", "span", "p", "form", "input", "button", "h3", "strong", "dl", "dt", "dd"})

    async def _serve(self, timeout_s: float) -> ApprovalBroker:
        # No grace after a page closes, and a quick keep-alive: a closed page stops counting at once.
        self.web = WebChannel(presence_grace_s=0.0, keepalive_s=0.05)
        broker = await self.broker([self.web], timeout_s)
        view = ControlView(
            sign_in=self.TOKENS.get,
            runs=lambda: [{"id": "r-1"}, {"id": "r-2"}],
            recent=lambda n: [],
            observers=[],
        )
        self.base = await self.stack.enter_async_context(control_server(broker.routes, listening_socket(), view=view))
        return broker

    async def _open_page(self, token: str = "global-token") -> PageClient:
        page = PageClient(self.base, self.web.prefix)
        self.stack.push_async_callback(page.close)
        await page.sign_in(token=token, name="alice")
        assert page.csrf is not None
        return page

    async def start(self, timeout_s: float) -> ApprovalBroker:
        broker = await self._serve(timeout_s)
        self.page = await self._open_page()
        self.stream = await self.stack.enter_async_context(self.page.http.get(self.page.url("events")))
        self.events = EventReader(self.stream)
        await self.events.until("ready")
        self.reading = asyncio.create_task(self._read())
        self.stack.push_async_callback(self._stop_reading)
        return broker

    async def _read(self) -> None:
        while True:
            await self.events.next(timeout_s=3600)

    async def _stop_reading(self) -> None:
        self.reading.cancel()
        await asyncio.gather(self.reading, return_exceptions=True)

    def _event(self, name: str, approval_id: str) -> Any:
        return next((d for e, d in self.events.seen if e == name and d["id"] == approval_id), None)

    async def shown(self, approval_id: str) -> str:
        await wait_until(lambda: self._event("approval", approval_id) is not None)
        _, _, page = await self.page.get()
        self.html = page
        card = re.search(rf'<li class="approval" id="approval-{re.escape(approval_id)}".*?</li>', page, re.S)
        assert card is not None, page
        # The card's text in its order: the intro, each field as "Label: value", the notes.
        parts = re.findall(r'<p class="intro">(.*?)</p>|<dt>(.*?)</dt><dd class="field [a-z-]+">(.*?)</dd>'
                           r'|<p class="(?:warning|hint|scope-note)">(.*?)</p>', card.group(0), re.S)  # fmt: skip
        lines = [intro or (f"{label}: {value}" if label else note) for intro, label, value, note in parts]
        return "\n".join(html.unescape(line) for line in lines)

    def inert(self) -> None:
        body = self.html[self.html.index('<ul id="approvals">') : self.html.index("</ul>")]
        tags = {name.lower() for name in re.findall(r"</?([A-Za-z][A-Za-z0-9]*)", body)}
        assert tags <= self.OWN_TAGS | {"ul"}, tags
        assert not [ch for ch in body if ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0], body

    async def _post(self, page: PageClient, approval_id: str, choice: Choice | str) -> bool:
        status, _, _ = await page.answer(approval_id, choice if isinstance(choice, str) else choice.value)
        if status != 303:
            assert status == 403, status
            return False
        _, _, text = await page.get()
        flash = re.search(r'<p class="flash" role="status">(.*?)</p>', text)
        assert flash is not None, text
        said = html.unescape(flash.group(1))  # "HOST:PORT (approval ID): how it was settled"
        return f"(approval {approval_id}): " in said or said.startswith(f"Approval {approval_id}: ")

    async def answer(self, approval_id: str, choice: Choice) -> bool | None:
        return await self._post(self.page, approval_id, choice)

    async def offered(self, approval_id: str) -> set[str]:
        await self.shown(approval_id)
        card = re.search(rf'<li class="approval" id="approval-{re.escape(approval_id)}".*?</li>', self.html, re.S)
        assert card is not None
        values = re.findall(r'<button type="submit" name="decision" value="([a-z]+)"', card.group(0))
        return {scope for allows, scope in map(DECISIONS.__getitem__, values) if allows and scope}

    async def answer_scoped(self, approval_id: str, scope: ApprovalScope) -> bool | None:
        # The button's value, posted also when the page did not show that button (a hand-made form).
        value = next(v for v, (allows, s) in DECISIONS.items() if allows and s == scope.value)
        return await self._post(self.page, approval_id, value)

    async def withdrawn(self, approval_id: str) -> str:
        await wait_until(lambda: self._event("settled", approval_id) is not None)
        return str(self._event("settled", approval_id)["text"])

    async def detach(self) -> None:
        await self._stop_reading()
        self.stream.close()  # the page is closed
        await wait_until(lambda: not self.web.attached_for("r-1"))

    async def never_attached(self) -> ApprovalBroker:
        return await self._serve(30.0)  # nobody signed in, no page open

    async def answer_unknown(self, pending_id: str, choice: Choice) -> bool | None:
        return await self._post(self.page, UNKNOWN_ID, choice)

    async def answer_foreign(self, own_id: str, other_id: str, choice: Choice) -> bool | None:
        own = next(d for e, d in self.events.seen if e == "approval" and d["id"] == own_id)
        return await self._post(await self._open_page(f"{own['run']}-token"), other_id, choice)


class ControlDriver(Driver):
    channel = "control"
    by = "carol"
    marks: ClassVar[dict[str, str]] = {kind: "no longer listed" for kind in ("allow", "deny", "timeout")}
    run_scoped = True  # a run's own token answers that run's approvals only
    goes_away = "the control API is no channel: it answers what channels hold, and is there while egressd is"
    TOKENS: ClassVar[dict[str, Scope]] = {
        "global-token": Scope(None),
        "r-1-token": Scope("r-1"),
        "r-2-token": Scope("r-2"),
    }

    async def start(self, timeout_s: float) -> ApprovalBroker:
        # A channel that shows approvals to nobody and never answers: only the control API answers them.
        broker = await self.broker([RecordingChannel("holder")], timeout_s)
        return await self._serve(broker)

    async def _serve(self, broker: ApprovalBroker) -> ApprovalBroker:
        served = control_server(broker.routes, listening_socket(), tokens=self.TOKENS)
        self.base = await self.stack.enter_async_context(served)
        return broker

    async def _call(self, method: str, path: str, *, token: str = "global-token", body: Any = None) -> tuple[int, Any]:
        async with ControlClient.for_url(self.base, token) as client:  # what ``egressd pending|allow|deny`` use
            return await client.request(method, path, body)

    async def _listed(self, approval_id: str) -> dict[str, Any] | None:
        status, body = await self._call("GET", "/approvals")
        assert status == 200, body
        self.last_listing = body
        return next((a for a in body["approvals"] if a["id"] == approval_id), None)

    async def shown(self, approval_id: str) -> str:
        listed = await poll(lambda: self._listed(approval_id))
        return str(listed["message"])

    def inert(self) -> None:
        for approval in self.last_listing["approvals"]:
            assert not [ch for ch in approval["message"] if ch != "\n" and is_invisible(ch)]

    async def _decide(self, approval_id: str, choice: Choice, token: str) -> bool:
        status, body = await self._call("POST", f"/approvals/{approval_id}/{choice.value}", token=token,
                                        body={"by": "carol"})  # fmt: skip
        assert status in (200, 403, 404, 409), (status, body)
        return status == 200

    async def answer(self, approval_id: str, choice: Choice) -> bool | None:
        return await self._decide(approval_id, choice, "global-token")

    async def withdrawn(self, approval_id: str) -> str:
        async def gone() -> bool:
            return await self._listed(approval_id) is None

        await poll(gone)
        return "no longer listed"

    async def never_attached(self) -> ApprovalBroker:
        return await self._serve(await self.broker([], 30.0))

    async def answer_unknown(self, pending_id: str, choice: Choice) -> bool | None:
        return await self._decide(UNKNOWN_ID, choice, "global-token")

    async def answer_foreign(self, own_id: str, other_id: str, choice: Choice) -> bool | None:
        own = await self._listed(own_id)
        assert own is not None
        return await self._decide(other_id, choice, f"{own['run']}-token")

    async def offered(self, approval_id: str) -> set[str]:
        listed = await poll(lambda: self._listed(approval_id))
        return set(listed["scopes"])

    async def answer_scoped(self, approval_id: str, scope: ApprovalScope) -> bool | None:
        status, body = await self._call(
            "POST", f"/approvals/{approval_id}/allow", body={"by": "carol", "scope": scope.value}
        )
        assert status in (200, 400), (status, body)
        return status == 200


class NobodyDriver(ControlDriver):
    """No channel attached: a terminal is configured and there is none (``serve`` with nobody at a terminal).

    Nobody is shown anything; the control API (``egressd allow|deny``) is the
    only way left to answer, and it finds nothing to answer.
    """

    channel = "nobody"
    by = "nobody"
    marks: ClassVar[dict[str, str]] = {}
    run_scoped = False
    goes_away = "nothing is attached that could go away"
    attached = False

    async def start(self, timeout_s: float) -> ApprovalBroker:
        nothing_there = TerminalChannel(tty_path=str(self.tmp_path / "no-tty"))
        return await self._serve(await self.broker([nothing_there], timeout_s))

    async def shown(self, approval_id: str) -> str:
        raise AssertionError(f"nobody is attached: approval {approval_id} cannot be shown")


class FleetDriver(ControlDriver):
    """The fleet (``serve --state``): the approval is held by one instance whose only channel is the fleet
    (a sidecar), and a person answers it through another instance's control API; the holder decides.

    Both instances are brokers here, on one real PostgreSQL (tests/postgres.py), each with its
    ``FleetChannel``; the answerer serves its control routes, which list what the holder holds.
    """

    channel = f"control@{ANSWERER}"
    goes_away = (
        "the fleet's database going away is tests/integration/fleet/test_approvals.py's outage test "
        "(a server of its own, stopped and started)"
    )
    postgres: ClassVar[Postgres | None] = None  # set by the ``driver`` fixture

    async def start(self, timeout_s: float) -> ApprovalBroker:
        assert self.postgres is not None
        dsn = await fleet_database(self.postgres, self.stack)
        holder = await self.broker([FleetChannel(dsn, HOLDER)], timeout_s)
        fleet = FleetChannel(dsn, ANSWERER)
        answerer = ApprovalBroker([fleet], audit=MemoryAuditSink(), timeout_s=timeout_s, elsewhere=fleet)
        self.stack.push_async_callback(answerer.close)
        await answerer.start()
        await self._serve(answerer)
        return holder

    async def never_attached(self) -> ApprovalBroker:
        # The database is not there: start-up stops, naming the setting.
        return await self.broker([FleetChannel(f"postgresql://egressd@/none?host={self.tmp_path}", HOLDER)], 30.0)


class FleetPageDriver(PageDriver):
    """The approvals page of another instance of the fleet: the approval is held by an instance whose one
    channel is the fleet; a person answers it on the page another instance serves (``WebChannel.elsewhere``,
    as approvals.assembly wires it); the holder decides. A page that is not the holder's says an approval
    was settled as "no longer waiting": the holder's page and records say how."""

    channel = f"web@{ANSWERER}"
    marks: ClassVar[dict[str, str]] = {kind: "no longer waiting" for kind in ("allow", "deny", "timeout")}
    goes_away = FleetDriver.goes_away
    postgres: ClassVar[Postgres | None] = None  # set by the ``driver`` fixture

    async def _serve(self, timeout_s: float) -> ApprovalBroker:
        assert self.postgres is not None
        dsn = await fleet_database(self.postgres, self.stack)
        holder = await self.broker([FleetChannel(dsn, HOLDER)], timeout_s)
        self.web = WebChannel(presence_grace_s=0.0, keepalive_s=0.05)
        fleet = FleetChannel(dsn, ANSWERER)
        self.web.elsewhere = fleet
        answerer = ApprovalBroker([self.web, fleet], audit=MemoryAuditSink(), timeout_s=timeout_s, elsewhere=fleet)
        self.stack.push_async_callback(answerer.close)
        await answerer.start()
        view = ControlView(
            sign_in=self.TOKENS.get,
            runs=lambda: [{"id": "r-1"}, {"id": "r-2"}],
            recent=lambda n: [],
            observers=[],
        )
        self.base = await self.stack.enter_async_context(
            control_server(answerer.routes, listening_socket(), view=view)
        )
        return holder

    async def never_attached(self) -> ApprovalBroker:
        return await self.broker([FleetChannel(f"postgresql://egressd@/none?host={self.tmp_path}", HOLDER)], 30.0)


async def fleet_database(server: Postgres, stack: AsyncExitStack) -> str:
    """A fresh database of the session's server, migrated, dropped when ``stack`` closes: a fleet's."""
    name = "c_" + secrets.token_hex(6)
    server.psql(f"CREATE DATABASE {name}")
    stack.callback(server.psql, f"DROP DATABASE {name} WITH (FORCE)")
    dsn = server.dsn(name)
    store = await Store.open(dsn)
    try:
        await store.migrate()
    finally:
        await store.close()
    return dsn


DRIVERS: dict[str, type[Driver]] = {
    "terminal": TerminalDriver,
    "slack": SlackDriver,
    "webhook": WebhookDriver,
    "web": PageDriver,
    "control": ControlDriver,
    "nobody": NobodyDriver,
    "fleet": FleetDriver,
    "fleet-web": FleetPageDriver,
}


def drivers(applies: Callable[[type[Driver]], bool]) -> Any:
    """Parametrise a check over the drivers it can be put to (not generated for the others: no skips)."""
    return pytest.mark.parametrize("driver", [name for name, d in DRIVERS.items() if applies(d)], indirect=True)


@pytest.fixture(params=list(DRIVERS))
async def driver(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Driver]:
    if DRIVERS[request.param] in (FleetDriver, FleetPageDriver):
        DRIVERS[request.param].postgres = request.getfixturevalue("postgres")  # type: ignore[attr-defined]
    async with AsyncExitStack() as stack:
        yield DRIVERS[request.param](stack, tmp_path)


# -- the checks ------------------------------------------------------------------------------


@pytest.mark.parametrize("choice", [Choice.ALLOW, Choice.DENY])
async def test_an_answer_decides_and_the_broker_records_who_answered_through_which_channel(
    driver: Driver, choice: Choice
) -> None:
    broker = await driver.start(timeout_s=30)
    if (held := await hold(driver, broker)) is None:
        return  # nobody attached: refused at once, nothing to answer
    waiting, approval_id = held
    await asyncio.sleep(0.05)
    assert not waiting.done()
    assert await driver.answer(approval_id, choice) is True
    outcome = await asyncio.wait_for(waiting, 5)
    answer = Answer.ALLOW if choice is Choice.ALLOW else Answer.DENY
    assert (outcome.answer, outcome.approval_id, outcome.channel, outcome.by) == (
        answer, approval_id, driver.channel, driver.by
    )  # fmt: skip
    [record] = decided(driver.audit)
    assert {k: record[k] for k in ("id", "run", "decision", "reason", "channel", "by")} == {
        "id": approval_id,
        "run": "r-1",
        "decision": choice.value,
        "reason": None if choice is Choice.ALLOW else "denied",
        "channel": driver.channel,
        "by": driver.by,
    }
    assert driver.marks[choice.value] in await driver.withdrawn(approval_id)


async def test_no_answer_in_time_is_an_approval_timeout_the_prompt_is_withdrawn_and_a_late_answer_refused(
    driver: Driver,
) -> None:
    broker = await driver.start(timeout_s=0.6)
    if (held := await hold(driver, broker)) is None:
        return  # nobody attached: refused at once (waited_s 0), before any deadline
    waiting, approval_id = held
    outcome = await asyncio.wait_for(waiting, 5)
    assert (outcome.answer, outcome.channel, outcome.by) == (Answer.TIMEOUT, None, None)
    [record] = decided(driver.audit)
    assert (record["decision"], record["reason"], record["channel"], record["by"]) == (
        "deny", "approval_timeout", None, None
    )  # fmt: skip
    assert driver.marks["timeout"] in await driver.withdrawn(approval_id)
    assert await driver.answer(approval_id, Choice.ALLOW) is not True
    assert decided(driver.audit) == [record] and broker.pending() == []


@drivers(lambda d: d.goes_away is None)
async def test_a_channel_that_went_away_admits_nothing_and_fails_closed(driver: Driver) -> None:
    # Long enough for Slack's two retries (slack-sdk adds up to 1 s of jitter to each) to give up first.
    broker = await driver.start(timeout_s=3.0)
    held = await hold(driver, broker)
    assert held is not None
    shown, shown_id = held
    await driver.detach()
    # What comes now cannot be shown to anybody: it fails for certain.
    assert_nobody_could_answer(driver, await asyncio.wait_for(broker.ask(request("next.example")), 10))
    # What was shown waits for an answer nobody can give any more: it expires.
    outcome = await asyncio.wait_for(shown, 10)
    assert (outcome.answer, outcome.channel, outcome.by) == (Answer.TIMEOUT, None, None)
    assert [r["reason"] for r in decided(driver.audit) if r["id"] == shown_id] == ["approval_timeout"]
    assert len(decided(driver.audit)) == 2 and broker.pending() == []


@drivers(lambda d: d.attached)
async def test_a_channel_never_attached_fails_closed(driver: Driver) -> None:
    try:
        broker = await driver.never_attached()
    except SetupError as exc:
        assert "bad setting" in str(exc)  # start-up stops, naming the setting: nothing runs half-attached
        return
    assert_nobody_could_answer(driver, await asyncio.wait_for(broker.ask(request()), 10))


async def test_an_answer_counts_once_and_a_second_one_changes_nothing(driver: Driver) -> None:
    broker = await driver.start(timeout_s=30)
    if (held := await hold(driver, broker)) is None:
        return  # nobody attached: not even a first answer counts
    waiting, first = held
    assert await driver.answer(first, Choice.ALLOW) is True
    assert (await asyncio.wait_for(waiting, 5)).allowed
    await driver.withdrawn(first)
    assert await driver.answer(first, Choice.DENY) is not True
    [record] = decided(driver.audit)
    assert (record["id"], record["decision"]) == (first, "allow")
    # Nor does the refused answer carry over to the next approval.
    later_held = await hold(driver, broker, request("next.example"))
    assert later_held is not None
    later, second = later_held
    await asyncio.sleep(0.3)
    assert not later.done() and [a.id for a in broker.pending()] == [second] and len(decided(driver.audit)) == 1
    assert await driver.answer(second, Choice.DENY) is True
    assert (await asyncio.wait_for(later, 5)).answer is Answer.DENY


@pytest.mark.parametrize(
    ("req", "domain"),
    [
        (HOSTILE, "Domain: login.xn--pyp-lhd.org:443 (shown as login.pypі.org; registered domain xn--pyp-lhd.org)"),
        (RELATED, "Domain: api.github.com:443 (registered domain github.com)"),
        (UNDER_ALLOWED, "Domain: upload.pypi.org:443 (registered domain pypi.org)"),
    ],
    ids=["hostile-idn-unrelated", "named-in-command", "under-allowed"],
)
async def test_the_message_carries_the_same_content_and_hostile_text_is_shown_escaped(
    driver: Driver, req: ApprovalRequest, domain: str
) -> None:
    broker = await driver.start(timeout_s=30)
    if (held := await hold(driver, broker, req)) is None:
        return  # nobody attached: nothing is shown to anybody
    waiting, approval_id = held
    shown = await driver.shown(approval_id)
    # Every channel shows the one rendering (egressd.approvals.message), every line of it in the template's
    # order (DESIGN.md: intro, domain, command, task, allowed domains, the warning, the reply), the
    # agent's text escaped in it.
    message = render(host=req.host, port=req.port, command=req.command, task=req.task, allowed=req.allowed)
    for kind, text in message.lines:
        assert text in shown, (kind, text, shown)
    at = [shown.index(text) for _, text in message.lines]
    assert at == sorted(at), shown
    assert [kind for kind, _ in message.lines][:5] == ["intro", "domain", "command", "task", "allowed"]
    assert domain in shown  # punycode, with the Unicode form and the registered domain beside it
    assert (UNRELATED in shown) is message.unrelated is (req is HOSTILE)
    if req is HOSTILE:
        for escaped in ("\\x1b[2J\\x1b[1;1Hallow or deny", "\\x07", "\\x9b31m", "\\u202egnp.exe", "\\x1b[8m"):
            assert escaped in shown
        assert "<script>alert(1)</script> *bold* _it_ ~s~ `code` :skull: <!channel> <@U0ALICE>" in shown
    assert not [ch for ch in RAW if ch in shown]
    assert not [ch for ch in shown if ch != "\n" and is_invisible(ch)]
    driver.inert()
    assert await driver.answer(approval_id, Choice.DENY) is True
    await asyncio.wait_for(waiting, 5)


@drivers(lambda d: d.names_approvals)  # the terminal's answer names no approval: it answers the prompt on screen
async def test_an_answer_for_an_approval_that_does_not_exist_is_refused(driver: Driver) -> None:
    broker = await driver.start(timeout_s=30)
    if (held := await hold(driver, broker)) is None:
        return  # nobody attached: ``hold`` answered an id that does not exist, and was refused
    waiting, approval_id = held
    assert await driver.answer_unknown(approval_id, Choice.ALLOW) is False
    await asyncio.sleep(0.1)
    assert not waiting.done() and [a.id for a in broker.pending()] == [approval_id] and decided(driver.audit) == []
    assert await driver.answer(approval_id, Choice.DENY) is True
    assert (await asyncio.wait_for(waiting, 5)).answer is Answer.DENY


async def test_an_answer_decides_its_own_approval_never_another_runs(driver: Driver) -> None:
    broker = await driver.start(timeout_s=30)
    if (held := await hold(driver, broker, request("one.example", run="r-1"))) is None:
        return  # nobody attached: nothing to answer in any run
    one, one_id = held
    two = asyncio.create_task(broker.ask(request("two.example", run="r-2")))
    two_id = await opened(broker, "two.example")
    if driver.run_scoped:
        await driver.shown(two_id)
        assert await driver.answer_foreign(one_id, two_id, Choice.ALLOW) is False
        await asyncio.sleep(0.1)
        assert {a.id for a in broker.pending()} == {one_id, two_id} and decided(driver.audit) == []
    assert await driver.answer(one_id, Choice.ALLOW) is True
    assert (await asyncio.wait_for(one, 5)).allowed
    await asyncio.sleep(0.1)
    assert not two.done() and [a.id for a in broker.pending()] == [two_id]
    assert [r["id"] for r in decided(driver.audit)] == [one_id]
    await driver.shown(two_id)
    assert await driver.answer(two_id, Choice.DENY) is True
    assert (await asyncio.wait_for(two, 5)).answer is Answer.DENY


# -- scopes: once, run, always ---------------------------------------------------------------

# The request as the gate asks it: with the entry an *always* answer keeps.
LASTING = replace(request(), lasting="evil.example:443")


@drivers(lambda d: d.attached)
@pytest.mark.parametrize("scope", list(ApprovalScope))
async def test_every_channel_offers_every_scope_and_the_one_chosen_is_applied_and_recorded(
    driver: Driver, scope: ApprovalScope
) -> None:
    driver.allow_file = driver.tmp_path / "allow.toml"
    broker = await driver.start(timeout_s=30)
    held = await hold(driver, broker, LASTING)
    assert held is not None
    waiting, approval_id = held
    assert await driver.offered(approval_id) == {"once", "run", "always"}
    assert await driver.answer_scoped(approval_id, scope) is True
    outcome = await asyncio.wait_for(waiting, 5)
    assert (outcome.answer, outcome.scope, outcome.channel, outcome.by) == (
        Answer.ALLOW, scope, driver.channel, driver.by
    )  # fmt: skip
    [record] = decided(driver.audit)
    always = scope is ApprovalScope.ALWAYS
    assert (record["decision"], record["scope"], record["entry"], record["scope_error"]) == (
        "allow", scope.value, "evil.example:443" if always else None, None
    )  # fmt: skip
    if always:
        [kept] = read_allow_file(driver.allow_file).approved
        assert (kept.entry, kept.approval, kept.by, kept.channel, kept.run) == (
            "evil.example:443", approval_id, driver.by, driver.channel, "r-1"
        )  # fmt: skip
    else:
        assert not driver.allow_file.exists()


@drivers(lambda d: d.attached)
async def test_without_an_allow_file_always_is_not_offered_and_asking_for_it_decides_nothing(driver: Driver) -> None:
    broker = await driver.start(timeout_s=30)
    held = await hold(driver, broker, LASTING)
    assert held is not None
    waiting, approval_id = held
    assert await driver.offered(approval_id) == {"once", "run"}
    assert await driver.answer_scoped(approval_id, ApprovalScope.ALWAYS) is False
    await asyncio.sleep(0.05)
    assert not waiting.done() and [a.id for a in broker.pending()] == [approval_id]
    assert decided(driver.audit) == []
    assert await driver.answer_scoped(approval_id, ApprovalScope.RUN) is True
    outcome = await asyncio.wait_for(waiting, 5)
    assert (outcome.answer, outcome.scope) == (Answer.ALLOW, ApprovalScope.RUN)
    assert [r["scope"] for r in decided(driver.audit)] == ["run"]

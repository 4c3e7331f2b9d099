"""What the proxy asks and what comes back, and where the broker meets its channels.

Two meeting points live here, so that nobody imports across them:

- the proxy and whatever answers: ``Approver.ask(ApprovalRequest) ->
  ApprovalOutcome`` (the ``deny`` approver, ``NoApprover``, the broker);
- the broker and its channels: a ``Channel`` is told about a
  ``PendingApproval`` (``deliver``), that every client waiting for it gave
  up (``abandoned``), and about its ``Settlement``
  (``settle``), and about what concerns no single approval (``notify``
  with a ``Notice``: a run stopped asking); it passes a person's answer
  back through the ``Answerer`` it was started with. The broker implements ``Answerer`` and holds channels
  only as ``Channel``; channels hold the broker only as ``Answerer``.

Approvers that need starting, stopping or routes on the control server
(the broker) are ``ManagedApprover``s; ``cli`` wires those.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from egressd.audit.records import rfc3339
from egressd.vocabulary.reasons import ANSWER_REASONS, Answer, Reason

from .message import ApprovalMessage, HeldRequest

if TYPE_CHECKING:
    from aiohttp import web



@dataclass(frozen=True, slots=True)
class ApprovalRequest:
    """A held connection's question: may this run reach host:port (and, inspected, make this request)?"""

    run_id: str
    host: str
    port: int
    command: str | None
    task: str | None
    allowed: tuple[str, ...]
    # The entry an *always* answer appends to the allowlist file: the exact
    # ``host:port`` in IDNA form, checked by the asker against the policy's
    # own parser; None when it has none (``lasting_error`` says why), and an
    # *always* answer then applies to the run only.
    lasting: str | None = None
    lasting_error: str | None = None
    # Inside an inspected connection: the request asked about (None: the destination alone).
    request: HeldRequest | None = None
    # An upload budget's question: the bytes the run has sent to ``host`` (its registered domain) so far.
    uploaded: int | None = None
    # The client's address (``host:port``) as the proxy saw it, for people; not part of the question.
    client: str | None = field(default=None, compare=False)
    # What the asker wants done with the answer when it comes after the asker
    # stopped waiting (its client gave up): the decision applies it to the run (``late_answer``).
    # Called once the approval settles, only when no client waits any more;
    # not part of the question (never compared, never shown).
    on_late_answer: Callable[[ApprovalOutcome], None] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class ApprovalOutcome:
    """The answer, with who gave it, through which channel, after how long."""

    answer: Answer
    approval_id: str | None = None
    channel: str | None = None
    by: str | None = None
    waited_s: float = 0.0
    # How far an allow reaches; None (an approver that knows no scopes) is RUN.
    scope: ApprovalScope | None = None

    @property
    def allowed(self) -> bool:
        return self.answer is Answer.ALLOW


class ApprovalScope(enum.Enum):
    """How far an allow reaches (``Scope`` in ``control`` is a control token's reach, not this).

    ONCE: the request(s) waiting on this approval when it is answered
    proceed and nothing joins the run, so the next connection asks again;
    RUN: the host joins the run's allowlist (on that port, 80 and 443) for
    the rest of the run, the default; ALWAYS: as RUN, and the exact
    ``host:port`` is appended to the operator's allowlist file
    (``--allow-file``), offered only when there is one.
    """

    ONCE = "once"
    RUN = "run"
    ALWAYS = "always"


def parse_scope(value: object) -> ApprovalScope | None:
    """A scope from an answer's ``scope`` field (``once|run|always``); None for anything else."""
    if value.__class__ is not str:
        return None
    try:
        return ApprovalScope(value)
    except ValueError:
        return None


class Approver(Protocol):
    """Answers approval requests. Must never raise for a denial: a denial is
    an outcome. An exception is treated by the caller as a denial (fail
    closed)."""

    async def ask(self, request: ApprovalRequest) -> ApprovalOutcome: ...


# -- the broker and its channels ----------------------------------------------


class Choice(enum.Enum):
    """What a person can choose when asked: allow or deny (``Answer`` is how the approval ended)."""

    ALLOW = "allow"
    DENY = "deny"


class AnswerResult(enum.Enum):
    """What became of an answer a channel passed on."""

    ACCEPTED = "accepted"  # it decided the approval
    SETTLED = "settled"  # the approval was already decided (by someone else, a timeout, shutdown)
    UNKNOWN = "unknown"  # no such approval (a wrong or long-forgotten id)
    NOT_OFFERED = "not_offered"  # the scope asked for is not offered (always, with no allow file): still open
    # Another instance of the fleet holds it and did not take the answer in time: nothing was decided.
    NOT_APPLIED = "not_applied"


@dataclass(frozen=True, slots=True)
class Settlement:
    """How one approval ended: the answer, who gave it where, when, after how long.

    ``channel`` and ``by`` are None when nobody answered (timeout, no
    approver, shutdown); ``by`` is the answerer's own words, while ``auth``
    names the credential that answered (``global token``, ``run token of
    r-1``, a page session), set by the channel, never by the answerer's text;
    None when the channel's own check is the credential (Slack's signature,
    the terminal). ``at`` is epoch seconds. ``scope`` is how far an
    allow reaches as applied (None for a denial); ``entry`` the line appended
    to the allowlist file for an *always*; ``scope_error`` why an *always*
    answer applies to the run only (the entry was refused, or could not be
    written).
    """

    answer: Answer
    channel: str | None
    by: str | None
    at: float
    waited_s: float
    scope: ApprovalScope | None = None
    entry: str | None = None
    scope_error: str | None = None
    auth: str | None = None

    @property
    def reason(self) -> Reason | None:
        """The refusal, or None for an allow."""
        return ANSWER_REASONS.get(self.answer)


def settled_text(settlement: Settlement) -> str:
    """One line saying how an approval ended, for people (escaped by the broker already)."""
    if settlement.channel is not None:
        verb = "denied"
        if settlement.reason is None:
            scope = settlement.scope.value if settlement.scope is not None else "run"
            verb = "allowed" if scope == "run" else f"allowed ({scope})"
        return f"{verb} by {settlement.by or 'someone'} via {settlement.channel}"
    return {
        Answer.TIMEOUT: "expired (denied)",
        Answer.NO_APPROVER: "denied: nobody could be asked",
        Answer.SHUTTING_DOWN: "denied: egressd stopped",
    }.get(settlement.answer, settlement.reason.value if settlement.reason is not None else "settled")


@dataclass(frozen=True, slots=True)
class Answered:
    """The result of ``Answerer.answer``, with the settlement when one is known."""

    result: AnswerResult
    settlement: Settlement | None = None


@dataclass(frozen=True, slots=True)
class PendingApproval:
    """One approval as a channel sees it.

    ``created_at`` and ``expires_at`` are epoch seconds (for people);
    ``deadline`` is the same expiry on the event loop's clock
    (``loop.time()``), for bounding network waits with
    ``asyncio.timeout_at``. ``abandoned``: every client that waited for it
    gave up and none waits now; it stays answerable until it expires, and
    an answer still applies to the run's later requests.
    """

    id: str
    request: ApprovalRequest
    message: ApprovalMessage
    created_at: float
    expires_at: float
    deadline: float
    abandoned: bool = False
    # The scopes a person may choose, in the order channels offer them.
    scopes: tuple[ApprovalScope, ...] = (ApprovalScope.ONCE, ApprovalScope.RUN)

    def offers(self, scope: ApprovalScope) -> bool:
        return scope in self.scopes

    def fields(self) -> dict[str, Any]:
        """The approval as JSON fields: the raw request, the rendered (escaped) message, the expiry.

        The webhook body and the control API's listing both start from these.
        """
        request = self.request
        return {
            "id": self.id,
            "run": request.run_id,
            "host": request.host,
            "port": request.port,
            "command": request.command,
            "task": request.task,
            "allowed": list(request.allowed),
            "request": None if request.request is None else {
                "method": request.request.method,
                "path": request.request.path,
                "query_names": list(request.request.query_names),
                "content_type": request.request.content_type,
                "length": request.request.length,
            },
            "uploaded": request.uploaded,
            "unrelated": self.message.unrelated,
            "message": self.message.text,
            "expires_at": rfc3339(self.expires_at),
            "scopes": [scope.value for scope in self.scopes],
        }


class NoticeKind(enum.Enum):
    """What a notice says; the value is the webhook event's ``type``."""

    STOPPED_ASKING = "run.stopped_asking"


@dataclass(frozen=True, slots=True)
class Notice:
    """Something every channel tells its people once, outside any approval.

    ``text`` is rendered once (``message``), already escaped; ``at`` is
    epoch seconds.
    """

    run_id: str
    text: str
    at: float
    kind: NoticeKind = NoticeKind.STOPPED_ASKING

    def fields(self) -> dict[str, Any]:
        """The notice as JSON fields (the webhook body)."""
        return {"type": self.kind.value, "run": self.run_id, "message": self.text, "at": rfc3339(self.at)}


class Answerer(Protocol):
    """The broker as channels and the control API see it."""

    def answer(
        self,
        approval_id: str,
        decision: Choice,
        *,
        channel: str,
        by: str | None,
        scope: ApprovalScope = ApprovalScope.RUN,
        auth: str | None = None,
    ) -> Answered:
        """Pass on a person's answer. The first valid answer decides; any
        later one gets ``SETTLED``; an allow with a scope the approval does
        not offer gets ``NOT_OFFERED`` and decides nothing. ``scope`` is
        ignored for a denial; ``auth`` is recorded as ``Settlement.auth``.
        Never raises for a bad id."""
        ...

    def pending(self) -> Sequence[PendingApproval]:
        """The approvals still waiting, oldest first."""
        ...


class Elsewhere(Protocol):
    """The approvals other instances of a fleet hold (``--state``), as this instance's control API sees them.

    The holder decides each one; an answer given here is passed to it, and
    what it says comes back as ``Answered`` (``NOT_APPLIED`` when it did not
    take the answer in time: nothing was decided).
    """

    async def listed(self) -> Sequence[tuple[str, dict[str, Any]]]:
        """(run id, the approval as the control API lists it) of each open approval held elsewhere."""
        ...

    async def runs(self) -> Sequence[tuple[str, dict[str, Any]]]:
        """(instance, the run as ``GET /runs`` lists it) of each live run of the other instances; empty when
        that cannot be known now."""
        ...

    async def outcome(self, approval_id: str) -> Settlement | None:
        """How an approval held elsewhere ended; None while it is open, or when no other instance holds it.
        ``ChannelError`` when that cannot be known now."""
        ...

    async def run_of(self, approval_id: str) -> str | None:
        """The run of an approval held elsewhere, open or settled; None when no other instance holds it.
        ``ChannelError`` when that cannot be known now (the database is gone)."""
        ...

    async def answer(
        self, approval_id: str, decision: Choice, *, channel: str, by: str | None, scope: ApprovalScope,
        auth: str | None,
    ) -> Answered:
        """Pass a person's answer to the approval's holder and say what became of it; ``ChannelError``
        (its message says whether anything may have been decided) when the database went away."""
        ...


Handler = Callable[["web.Request"], Awaitable["web.StreamResponse"]]


@dataclass(frozen=True, slots=True)
class Route:
    """A route a channel or the broker serves on the control server.

    ``public`` routes skip the bearer token: their own signature check is the
    credential (the webhook callback, Slack's interactivity endpoint).
    ``page``: the address a person opens in a browser (the approvals page),
    printed at start-up.
    """

    method: str
    path: str
    handler: Handler
    public: bool = False
    page: bool = False


class SetupError(Exception):
    """A configured approval channel cannot work; the message names the setting.

    Stops start-up: nothing starts half-configured.
    """


class ChannelUnavailable(Exception):
    """The channel has nothing to attach to (no terminal): it is left out, not an error."""


class ChannelError(Exception):
    """A channel could not do what was asked (deliver, settle); the broker treats it as a failure."""


class Channel(Protocol):
    """A way to reach a person: the terminal, Slack, a webhook."""

    name: str

    async def start(self, answerer: Answerer) -> None:
        """Get ready. Raise ``ChannelUnavailable`` when there is nothing to
        attach to, ``SetupError`` when the configuration cannot work."""
        ...

    async def deliver(self, approval: PendingApproval) -> None:
        """Put the approval in front of a person; return once it is there.

        Raise (anything) when it could not be delivered; ``ChannelUnavailable``
        when nobody is there to deliver to just now (the approvals page is
        closed), which is expected and logged quietly. The broker bounds the
        call by the approval's deadline.
        """
        ...

    async def settle(self, approval: PendingApproval, settlement: Settlement) -> None:
        """The approval is decided: update or withdraw what was shown."""
        ...

    async def notify(self, notice: Notice) -> None:
        """Show a notice once. Best effort: the broker bounds the call and logs a failure."""
        ...

    async def abandoned(self, approval: PendingApproval) -> None:
        """Every client waiting for this shown approval gave up: say so once (it stays answerable).

        Called once per approval, after ``deliver`` returned. Best effort:
        the broker bounds the call and logs a failure.
        """
        ...

    async def close(self) -> None: ...

    def routes(self) -> Sequence[Route]:
        """Routes this channel needs on the control server (may be empty)."""
        ...


@runtime_checkable
class ManagedApprover(Protocol):
    """An approver with a lifetime and control routes (the broker)."""

    async def ask(self, request: ApprovalRequest) -> ApprovalOutcome: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def routes(self) -> Sequence[Route]: ...

"""One attempt, before and after the decision: what the conversation learnt, decided and recorded.

``Seen`` is what the conversation (``conversation``) has learnt before the
decision; ``Attempt`` is what is decided (``decision``) and recorded
(``egressd.proxy.net.recorder``); ``Admission`` is the decision's answer;
``DialError`` why no upstream connection could be made. Pure values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from egressd.audit.records import ApprovalSummary, EgressDecided
from egressd.names.addresses import IPAddress
from egressd.proxy.core.runs import Run
from egressd.vocabulary.egress import Decision, EgressKind
from egressd.vocabulary.reasons import Reason


class Seen(NamedTuple):
    """What the conversation has learnt about one attempt before the decision: a value, never edited.

    ``Recorder.begin`` makes the first (its identity: id, kind, client, when);
    the way in makes each next one as it learns more (``_replace``: the kind
    and destination from the request, the run it is attributed to).
    ``Recorder.record_refusal`` records an attempt refused before the policy ran; the
    conversation starts an ``Attempt`` from it otherwise. ``command`` is the
    run's current command where the attempt was attributed (``attributed``),
    not where only the run its source address is bound to is known.
    """

    id: str
    kind: EgressKind
    client: str | None
    ts: float
    started: float
    host: str | None = None
    port: int | None = None
    run: Run | None = None
    command: str | None = None

    def attributed(self, run: Run) -> Seen:
        """The same attempt, made in ``run`` for its current command."""
        return self._replace(run=run, command=run.command)


@dataclass(slots=True)
class Attempt:
    """One attempt the decision decides, from the conversation's ``Seen`` to its records.

    Who sets what: the conversation its identity, run and destination;
    ``decision.conclude`` the decision, once, from the ``Admission`` (``decision``, ``reason``, ``rule``,
    ``approval``, ``learned``; an address refused, ``message``); the
    recorder the address written ahead (``open``: ``ahead``) and ``counted``;
    the dialer the address that answered; the runner what the connection did
    (the byte counters, ``end``, and the notes the record carries after its
    fields: ``status``, ``sni``, ``request_host``, ``detail``). The recorder turns it
    into facts (``egressd.audit.records``): the ``EgressDecided`` written ahead
    of an allowed dial, or for a refusal the final one; and the
    ``EgressEnded`` of an opened connection.
    """

    id: str
    kind: EgressKind
    client: str | None
    ts: float
    started: float
    run: Run | None = None
    host: str | None = None
    port: int | None = None
    address: str | None = None
    decision: Decision = Decision.DENY
    reason: str | None = None
    rule: str | None = None
    approval: ApprovalSummary | None = None
    # Learn mode: the reason code the policy would have refused this with (its records' ``learned``).
    learned: str | None = None
    command: str | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    # Why an opened connection ended when that is not its decision's reason (``closed``, ``idle_timeout``, ...).
    end: str | None = None
    # The phrase a refused client reads instead of the reason's usual one (``Reason.message``).
    message: str | None = None
    # Notes, written after the record's fields when set (``notes``):
    status: int | None = None  # the origin's response status (plain HTTP)
    sni: str | None = None  # the name a tunnel's ClientHello asked for instead of the host
    request_host: str | None = None  # the host a tunnel's plain HTTP request named instead
    detail: str | None = None  # why, in words (the first cause said stays)
    decided: bool = False
    counted: bool = False  # in the metrics and the decision log (``Recorder``), once
    # Its ``egress`` record, written ahead (``Recorder.open``): what ends it is an ``egress.end`` record.
    ahead: EgressDecided | None = None
    # That fact's record as written, kept so the end folds into it without serialising it again.
    ahead_record: dict[str, object] | None = None
    finished: bool = False

    @property
    def opened(self) -> bool:
        return self.ahead is not None

    def deny(self, reason: Reason | str, detail: str | None = None) -> None:
        """Deny with ``reason``; ``detail`` says more unless something already did."""
        self.decision = Decision.DENY
        self.reason = reason.value if isinstance(reason, Reason) else reason
        if detail and self.detail is None:
            self.detail = detail

    def notes(self, learned: bool = True) -> dict[str, object] | None:
        """The notes set, in the record's order (``learned`` first, when asked for); None when none is."""
        notes: dict[str, object] = {}
        if learned and self.learned is not None:
            notes["learned"] = self.learned
        if self.status is not None:
            notes["status"] = self.status
        if self.sni is not None:
            notes["sni"] = self.sni
        if self.request_host is not None:
            notes["request_host"] = self.request_host
        if self.detail is not None:
            notes["detail"] = self.detail
        return notes or None

    def ends(self, end: str) -> None:
        """Say why the connection ended, unless something already did."""
        if self.end is None:
            self.end = end


class Admission(NamedTuple):
    """The decision, whole, built once (``decision.decide``): addresses to dial, or the reason for refusing.

    With it, what the record says of how it was reached: the policy's rule,
    the approval asked for, learn mode's code; for a refusal, the address it
    concerned, the phrase the client reads instead of the reason's, and why.
    A tuple: one is made for every request.
    """

    reason: Reason | None
    host: str  # as the policy normalised it
    port: int
    addresses: tuple[IPAddress, ...] = ()
    texts: tuple[str, ...] = ()  # the addresses as text, in the same order
    rule: str | None = None
    approval: ApprovalSummary | None = None
    learned: str | None = None  # learn mode: the reason code the policy would have refused this with
    address: str | None = None  # a refused address
    message: str | None = None  # the phrase a refused client reads instead of the reason's
    detail: str | None = None

    @property
    def allowed(self) -> bool:
        return self.reason is None


class DialError(Exception):
    """Could not connect upstream; ``reason`` is the code the client sees."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason

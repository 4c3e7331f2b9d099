"""One attempt, before and after the decision: what the conversation learnt, decided and recorded.

``Seen`` is what the conversation (``conversation``) has learnt before the
decision (what was asked); ``Admission`` the decision's answer (what was
decided); ``Attempt`` the three stages together, with what happened, as the
recorder (``egressd.proxy.net.recorder``) writes them;
``DialError`` why no upstream connection could be made. Pure values.
"""

from __future__ import annotations

from typing import NamedTuple

from egressd.approvals.interface import HeldRequest
from egressd.audit.records import ApprovalSummary, EgressDecided
from egressd.names.addresses import IPAddress
from egressd.proxy.core.runs import Run
from egressd.vocabulary.egress import Decision, EgressKind, End
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


class Attempt:
    """One attempt, in three stages, each written once by the one who knows it.

    - What was asked: made from the conversation's ``Seen`` (identity,
      destination, run, command) with the destination the way in found
      (``Attempt(seen, host, port, run, kind)``), never edited after.
    - What was decided: ``conclude``, once, from the ``Admission``
      (``admission``, ``decision``, ``reason``, ``rule``, ``approval``,
      ``learned``, ``message``; ``host`` as the policy normalised it).
    - What happened: ``deny`` when a connection is refused after (or
      without) its decision (a dial that failed, a tunnel overruled, a client
      gone: ``cut``, the first cause stays); the recorder the address written
      ahead (``open``) and the dialer the one that answered (``address``);
      the runner the byte counters, ``end`` and the notes the record carries
      after its fields (``status``, ``sni``, ``request_host``, ``detail``).

    The stages' fields are plain slots, written only through ``conclude``,
    ``deny`` and ``ends`` (an attempt is made per request: no property
    stands between the recorder and them). The recorder turns it into facts
    (``egressd.audit.records``): the ``EgressDecided`` written ahead of an
    allowed dial, or for a refusal the final one; and the ``EgressEnded`` of
    an opened connection. Its own bookkeeping (``counted``, ``ahead``,
    ``finished``) is the recorder's.
    """

    __slots__ = (
        "id", "kind", "client", "ts", "started", "run", "host", "port", "command",
        "admission", "decision", "reason", "rule", "approval", "learned", "message", "cut",
        "address", "bytes_up", "bytes_down", "end", "method", "path", "shown", "status", "sni", "request_host",
        "detail", "counted", "ahead", "ahead_record", "finished",
    )  # fmt: skip

    def __init__(
        self,
        seen: Seen,
        host: str | None = None,
        port: int | None = None,
        run: Run | None = None,
        kind: EgressKind | None = None,
    ) -> None:
        # What was asked.
        self.id = seen.id
        self.kind = seen.kind if kind is None else kind
        self.client = seen.client
        self.ts = seen.ts
        self.started = seen.started
        self.run = seen.run if run is None else run
        self.host = seen.host if host is None else host
        self.port = seen.port if port is None else port
        self.command = seen.command if run is None else run.command
        # What was decided (``conclude``): refused until it is.
        self.admission: Admission | None = None
        self.decision = Decision.DENY
        self.reason: Reason | None = None
        self.rule: str | None = None
        self.approval: ApprovalSummary | None = None
        self.learned: Reason | None = None  # learn mode: the reason the policy would have refused this with
        self.message: str | None = None  # the phrase a refused client reads instead of the reason's usual one
        # What happened.
        self.cut: Reason | None = None
        self.address: str | None = None
        self.bytes_up = 0
        self.bytes_down = 0
        self.end: End | None = None
        # An inspected request's method and normalised path, without the query (its record's ``method``, ``path``).
        self.method: str | None = None
        self.path: str | None = None
        self.shown: HeldRequest | None = None  # the same request as an approver is shown it (a cap's question)
        self.status: int | None = None  # the origin's response status (plain HTTP)
        self.sni: str | None = None  # the name a tunnel's ClientHello asked for instead of the host
        self.request_host: str | None = None  # the host a tunnel's plain HTTP request named instead
        self.detail: str | None = None  # why, in words (the first cause said stays)
        # The recorder's.
        self.counted = False  # in the metrics and the decision log (``Recorder``), once
        # Its ``egress`` record, written ahead (``Recorder.open``): what ends it is an ``egress.end`` record.
        self.ahead: EgressDecided | None = None
        # That fact's record as written, kept so the end folds into it without serialising it again.
        self.ahead_record: dict[str, object] | None = None
        self.finished = False

    def __repr__(self) -> str:
        return f"Attempt({self.id} {self.kind} {self.host}:{self.port} {self.decision} {self.reason})"

    @property
    def decided(self) -> bool:
        return self.admission is not None

    @property
    def opened(self) -> bool:
        return self.ahead is not None

    @property
    def recorded_address(self) -> str | None:
        """The address the record names: the one written ahead or dialled, else the one refused."""
        if self.address is not None:
            return self.address
        admission = self.admission
        return admission.address if admission is not None else None

    def conclude(self, admission: Admission) -> None:
        """The decision, once (``decision.conclude``); its ``detail`` is the first cause said."""
        if self.admission is not None:
            raise ValueError(f"attempt {self.id} is decided already")
        self.admission = admission
        self.host = admission.host
        self.rule, self.approval, self.learned = admission.rule, admission.approval, admission.learned
        reason = admission.reason
        if reason is None:
            self.decision = Decision.ALLOW
        else:
            self.reason, self.message = reason, admission.message
            if admission.detail and self.detail is None:
                self.detail = admission.detail

    def deny(self, reason: Reason, detail: str | None = None) -> None:
        """Refuse it for ``reason`` (what happened after, or without, its decision), unless already refused."""
        if self.reason is None:
            self.cut = self.reason = reason
            self.decision = Decision.DENY
            self.message = None
        if detail and self.detail is None:
            self.detail = detail

    def notes(self, learned: bool = True, request: bool = True) -> dict[str, object] | None:
        """The notes set, in the record's order (``learned`` and the request first, when asked for); None when none is.

        ``egress.end`` asks for neither: its ``egress`` record, written ahead, has them.
        """
        notes: dict[str, object] = {}
        if learned and self.learned is not None:
            notes["learned"] = self.learned.value
        if request and self.method is not None:
            notes["method"] = self.method
            notes["path"] = self.path
        if self.status is not None:
            notes["status"] = self.status
        if self.sni is not None:
            notes["sni"] = self.sni
        if self.request_host is not None:
            notes["request_host"] = self.request_host
        if self.detail is not None:
            notes["detail"] = self.detail
        return notes or None

    def ends(self, end: End) -> None:
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
    learned: Reason | None = None  # learn mode: the reason the policy would have refused this with
    address: str | None = None  # a refused address
    message: str | None = None  # the phrase a refused client reads instead of the reason's
    detail: str | None = None
    inspect: bool = False  # allowed, and its TLS is to be taken over: each request decided on its own

    @property
    def allowed(self) -> bool:
        return self.reason is None


class DialError(Exception):
    """Could not connect upstream; ``reason`` is the code the client sees."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason

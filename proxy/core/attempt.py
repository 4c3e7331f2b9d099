"""One attempt, before and after the decision: what the conversation learnt, decided and recorded.

``Seen`` is what the conversation (``conversation``) has learnt before the
decision (what was asked); ``Admission`` the decision's answer (what was
decided); ``Attempt`` the three stages together, with what happened, as the
recorder (``egressd.proxy.net.recorder``) writes them;
``DialError`` why no upstream connection could be made. Pure values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

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


@dataclass(slots=True)
class Attempt:
    """One attempt, in three stages, each written once by the one who knows it.

    - What was asked: ``seen``, the conversation's last ``Seen`` (identity, destination,
      run, command), a value.
    - What was decided: ``admission``, set once by ``decision.conclude``; the
      decision's record fields (``decision``, ``reason``, ``rule``, ``approval``,
      ``learned``, ``message``) are read from it.
    - What happened: ``cut``, the reason a connection was refused after (or
      without) its decision (a dial that failed, a tunnel overruled, a client
      gone), once; the recorder the address written ahead (``open``) and the
      dialer the one that answered (``address``); the runner the byte counters,
      ``end`` and the notes the record carries after its fields (``status``,
      ``sni``, ``request_host``, ``detail``: the first cause said stays).

    The recorder turns it into facts (``egressd.audit.records``): the
    ``EgressDecided`` written ahead of an allowed dial, or for a refusal the
    final one; and the ``EgressEnded`` of an opened connection. Its own
    bookkeeping (``counted``, ``ahead``, ``finished``) is the recorder's.
    """

    seen: Seen
    admission: Admission | None = None
    cut: Reason | None = None
    address: str | None = None
    bytes_up: int = 0
    bytes_down: int = 0
    end: End | None = None
    status: int | None = None  # the origin's response status (plain HTTP)
    sni: str | None = None  # the name a tunnel's ClientHello asked for instead of the host
    request_host: str | None = None  # the host a tunnel's plain HTTP request named instead
    detail: str | None = None  # why, in words (the first cause said stays)
    counted: bool = False  # in the metrics and the decision log (``Recorder``), once
    # Its ``egress`` record, written ahead (``Recorder.open``): what ends it is an ``egress.end`` record.
    ahead: EgressDecided | None = None
    # That fact's record as written, kept so the end folds into it without serialising it again.
    ahead_record: dict[str, object] | None = None
    finished: bool = False

    # -- what was asked ------------------------------------------------------------------------

    @property
    def id(self) -> str:
        return self.seen.id

    @property
    def kind(self) -> EgressKind:
        return self.seen.kind

    @property
    def client(self) -> str | None:
        return self.seen.client

    @property
    def ts(self) -> float:
        return self.seen.ts

    @property
    def started(self) -> float:
        return self.seen.started

    @property
    def run(self) -> Run | None:
        return self.seen.run

    @property
    def port(self) -> int | None:
        return self.seen.port

    @property
    def command(self) -> str | None:
        return self.seen.command

    @property
    def host(self) -> str | None:
        """The host as the policy normalised it once decided; as asked before."""
        admission = self.admission
        return admission.host if admission is not None else self.seen.host

    # -- what was decided, and what became of it ---------------------------------------------

    @property
    def decided(self) -> bool:
        return self.admission is not None

    @property
    def decision(self) -> Decision:
        admission = self.admission
        if self.cut is None and admission is not None and admission.reason is None:
            return Decision.ALLOW
        return Decision.DENY

    @property
    def reason(self) -> Reason | None:
        """Why it was refused: what cut it, else the decision's reason (None: allowed, or never decided)."""
        if self.cut is not None:
            return self.cut
        admission = self.admission
        return admission.reason if admission is not None else None

    @property
    def rule(self) -> str | None:
        admission = self.admission
        return admission.rule if admission is not None else None

    @property
    def approval(self) -> ApprovalSummary | None:
        admission = self.admission
        return admission.approval if admission is not None else None

    @property
    def learned(self) -> Reason | None:
        """Learn mode: the reason the policy would have refused this with (its records' ``learned``)."""
        admission = self.admission
        return admission.learned if admission is not None else None

    @property
    def message(self) -> str | None:
        """The phrase a refused client reads instead of the reason's usual one (``Reason.message``)."""
        admission = self.admission
        return admission.message if admission is not None and self.cut is None else None

    @property
    def recorded_address(self) -> str | None:
        """The address the record names: the one written ahead or dialled, else the one refused."""
        if self.address is not None:
            return self.address
        admission = self.admission
        return admission.address if admission is not None else None

    @property
    def opened(self) -> bool:
        return self.ahead is not None

    def conclude(self, admission: Admission) -> None:
        """The decision, once (``decision.conclude``); its ``detail`` is the first cause said."""
        if self.admission is not None:
            raise ValueError(f"attempt {self.seen.id} is decided already")
        self.admission = admission
        if admission.detail and self.detail is None:
            self.detail = admission.detail

    def deny(self, reason: Reason, detail: str | None = None) -> None:
        """Refuse it for ``reason`` (what happened after, or without, the decision), unless already refused so."""
        if self.cut is None and (self.admission is None or self.admission.reason is None):
            self.cut = reason
        if detail and self.detail is None:
            self.detail = detail

    def notes(self, learned: bool = True) -> dict[str, object] | None:
        """The notes set, in the record's order (``learned`` first, when asked for); None when none is."""
        notes: dict[str, object] = {}
        if learned:
            would = self.learned
            if would is not None:
                notes["learned"] = would.value
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

    @property
    def allowed(self) -> bool:
        return self.reason is None


class DialError(Exception):
    """Could not connect upstream; ``reason`` is the code the client sees."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason

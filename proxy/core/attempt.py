"""One attempt as the connection core and the gate see it, before and after the decision.

``Seen`` is what the conversation (``conversation``) has learnt before the
gate decides; ``Attempt`` is what the gate decides and records
(``egressd.proxy.net.gate``); ``Admission`` is the gate's answer;
``DialError`` why no upstream connection could be made. Pure values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from egressd.audit.records import ApprovalSummary, Decision, EgressDecided, EgressKind
from egressd.names.addresses import IPAddress
from egressd.proxy.core.reasons import Reason
from egressd.proxy.core.runs import Run


class Seen(NamedTuple):
    """What a listener has learnt about one attempt before the gate decides it: a value, never edited.

    ``Gate.begin`` makes the first (its identity: id, kind, client, when);
    the listener makes each next one as it learns more (``_replace``: the
    kind and destination from the request head, the run it is attributed
    to; a tuple, since one is made for every request). It goes into the gate whole: ``Gate.refuse`` records an
    attempt refused before the policy ran, ``Gate.attempt`` starts the one
    the gate decides. ``command`` is the run's current command where the
    listener attributed the attempt itself (``attributed``), not where it
    only knows the run its source address is bound to.
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
    """One attempt the gate decides, from ``Gate.attempt`` (what the listener ``Seen``) to its record.

    The gate turns it into facts (``egressd.audit.records``), each built once: the
    ``EgressDecided`` written ahead of an allowed dial (``Gate.open``, kept
    as ``ahead``) or, for a refusal, the final one (``Gate.finish``); and the
    ``EgressEnded`` of an opened connection (``Gate.finish``, from the bytes,
    the duration and ``end``). Who sets what: ``Gate.attempt`` the identity,
    run and destination, from the listener's ``Seen``; ``Gate.admit`` the
    decision (``decision``, ``reason``, ``rule``, ``approval``); ``Gate.dial``
    the address; then the listener what the connection did: a refusal after
    the decision (``refuse``), the byte counters, ``extra`` notes
    (``status``, ``sni``, ``detail``, in the order they came: the record
    keeps it) and ``end``. The byte counters are the listener's alone
    (``server`` and ``listener.Held``, which add what each relay moved). An
    attempt refused before the policy ran never becomes one: ``Gate.refuse``
    records its ``Seen``. The DNS server keeps no attempt either: a query is
    decided at once, and it builds the query's fact itself (``Gate.settle``).
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
    extra: dict[str, object] = field(default_factory=dict)
    decided: bool = False
    counted: bool = False  # in the metrics and the decision log (``Recorder``), once
    # Its ``egress`` record, written ahead (``Gate.open``): what ends it is an ``egress.end`` record.
    ahead: EgressDecided | None = None
    # That fact's record as written, kept so the end folds into it without serialising it again.
    ahead_record: dict[str, object] | None = None
    finished: bool = False

    @property
    def opened(self) -> bool:
        return self.ahead is not None

    def refuse(self, reason: Reason | str, detail: str | None = None) -> None:
        """Deny with ``reason``; ``detail`` says more unless something already did."""
        self.decision = Decision.DENY
        self.reason = reason.value if isinstance(reason, Reason) else reason
        if detail:
            self.extra.setdefault("detail", detail)

    def ends(self, end: str) -> None:
        """Say why the connection ended, unless something already did."""
        if self.end is None:
            self.end = end


@dataclass(frozen=True, slots=True)
class Admission:
    """The gate's answer: addresses to dial, or the reason for refusing."""

    reason: Reason | None
    host: str
    port: int
    addresses: tuple[IPAddress, ...] = ()
    texts: tuple[str, ...] = ()  # the addresses as text, in the same order

    @property
    def allowed(self) -> bool:
        return self.reason is None


class DialError(Exception):
    """Could not connect upstream; ``reason`` is the code the client sees."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason

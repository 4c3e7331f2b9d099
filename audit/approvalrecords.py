"""The approval records: ``approval.requested``, ``approval.decided`` and ``approval.abandoned``.

Facts built once where they are known (``egressd.approvals.broker``), each
``record()`` the dict the writer serialises, keys in the design's order.
Pure, like ``records``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from egressd.audit.fields import member, plain, seconds, strip_host
from egressd.audit.records import APPROVAL_ABANDONED, APPROVAL_DECIDED, APPROVAL_REQUESTED, DECISIONS, rfc3339
from egressd.vocabulary.egress import Decision
from egressd.vocabulary.reasons import Reason


@dataclass(frozen=True, slots=True)
class ApprovalRequested:
    """A person was asked: the ``approval.requested`` record.

    ``id`` is the approval's id (what ``egressd allow ID`` takes);
    ``channels`` names the channels the message went to.
    """

    id: str  # the design's field name, shadowing the builtin
    ts: float
    run: str | None
    host: str
    port: int
    command: str | None
    channels: Sequence[str]

    def record(self) -> dict[str, object]:
        return {
            "event": APPROVAL_REQUESTED,
            "id": self.id,
            "ts": rfc3339(self.ts),
            "run": self.run,
            "host": strip_host(self.host),
            "port": self.port,
            "command": self.command,
            "channels": [str(channel) for channel in self.channels],
        }


@dataclass(frozen=True, slots=True)
class ApprovalSettled:
    """How an approval was decided: the ``approval.decided`` record.

    ``decision`` is allow or deny (anything else: ``RecordError``);
    ``reason`` the refusal code of a denial (``denied``,
    ``approval_timeout``, ...); ``channel`` and ``by`` are None when nobody
    answered. ``run`` is not in the design's field list but lets
    ``egressd audit --run`` keep the answer next to its request.
    After the design's fields: ``scope``, how far an allow reaches as
    applied (``once|run|always``; None for a denial); ``entry``, the line an
    *always* answer appended to the allowlist file; ``scope_error``, why an
    *always* answer was applied to the run only. Last, when known,
    ``auth``: the credential that answered (``global token``, ``run token
    of r-1``, ``page session "alice" (global token)``), set by egressd,
    never by the answerer's own text as ``by`` is.
    """

    id: str  # the design's field name, shadowing the builtin
    ts: float
    decision: Decision
    reason: Reason | str | None  # a code read back from a record is a string
    channel: str | None
    by: str | None
    waited_s: float | None
    run: str | None = None
    scope: str | None = None
    entry: str | None = None
    scope_error: str | None = None
    auth: str | None = None

    def __post_init__(self) -> None:
        if self.decision.__class__ is not Decision:
            object.__setattr__(self, "decision", Decision(member(self.decision, DECISIONS, "decision")))

    def record(self) -> dict[str, object]:
        reason = self.reason
        record: dict[str, object] = {
            "event": APPROVAL_DECIDED,
            "id": self.id,
            "ts": rfc3339(self.ts),
            "run": self.run,
            "decision": Decision(self.decision).value,
            "reason": reason if reason.__class__ is str else plain(reason),
            "channel": plain(self.channel),
            "by": self.by,
            "waited_s": seconds(self.waited_s, "waited_s"),
            "scope": plain(self.scope),
            "entry": plain(self.entry),
            "scope_error": plain(self.scope_error),
        }
        if self.auth is not None:
            record["auth"] = self.auth
        return record


@dataclass(frozen=True, slots=True)
class ApprovalAbandoned:
    """Every client waiting for an approval gave up: the ``approval.abandoned`` record.

    The approval stays open until answered or expired; its
    ``approval.decided`` record follows as for any other. ``waited_s`` is
    how long it had been open when the last client left.
    """

    id: str  # the design's field name, shadowing the builtin
    ts: float
    run: str | None
    host: str
    port: int
    waited_s: float | None

    def record(self) -> dict[str, object]:
        return {
            "event": APPROVAL_ABANDONED,
            "id": self.id,
            "ts": rfc3339(self.ts),
            "run": self.run,
            "host": strip_host(self.host),
            "port": self.port,
            "waited_s": seconds(self.waited_s, "waited_s"),
        }


def approval_requested_record(
    *,
    id: str,  # the design's field name, shadowing the builtin
    ts: float,
    run: str | None,
    host: str,
    port: int,
    command: str | None,
    channels: Sequence[str],
) -> dict[str, object]:
    """The ``approval.requested`` record of an ``ApprovalRequested`` built from these fields."""
    return ApprovalRequested(id=id, ts=ts, run=run, host=host, port=port, command=command, channels=channels).record()


def approval_decided_record(
    *,
    id: str,  # the design's field name, shadowing the builtin
    ts: float,
    decision: str,
    reason: Reason | str | None,
    channel: str | None,
    by: str | None,
    waited_s: float | None,
    run: str | None = None,
    scope: str | None = None,
    entry: str | None = None,
    scope_error: str | None = None,
    auth: str | None = None,
) -> dict[str, object]:
    """The ``approval.decided`` record of an ``ApprovalSettled`` built from these fields (``RecordError``)."""
    return ApprovalSettled(
        id=id,
        ts=ts,
        decision=decision,  # type: ignore[arg-type]  # checked and converted by the fact
        reason=reason,
        channel=channel,
        by=by,
        waited_s=waited_s,
        run=run,
        scope=scope,
        entry=entry,
        scope_error=scope_error,
        auth=auth,
    ).record()


def approval_abandoned_record(
    *,
    id: str,  # the design's field name, shadowing the builtin
    ts: float,
    run: str | None,
    host: str,
    port: int,
    waited_s: float | None,
) -> dict[str, object]:
    """The ``approval.abandoned`` record of an ``ApprovalAbandoned`` built from these fields."""
    return ApprovalAbandoned(id=id, ts=ts, run=run, host=host, port=port, waited_s=waited_s).record()

"""Audit facts, and the records they serialise to (plain dicts, one JSON line each).

A fact is what happened, typed and frozen, built once where it is known:
``EgressDecided`` (an attempt's ``egress`` record) and ``EgressEnded`` (an
allowed connection's ``egress.end``) here, the approval facts in
``approvalrecords``. Its ``record()`` is the dict the writer serialises,
keys in the design's order. A fact's ``record()``, or its building, checks
what its types cannot (``fields.RecordError``); ``run_record`` and the other
``*_record`` functions build a record from keyword arguments.

Pure: no I/O, no clock (every fact and builder takes ``ts``, epoch seconds), no
environment. The one exception is ``new_request_id``, which draws from
``secrets`` because a request id must be unguessable.

What a record may never hold (DESIGN.md, "Audit log"): payloads, credentials
and query strings. Callers already strip them; the builders strip them
again (``fields``), because a leak into an append-only log cannot be taken back.

``prev`` (the hash chain) is not built here: it is the SHA-256 of the line
written before, known only to the writer at the moment it writes
(``egressd.audit.log.JsonlAuditSink``), so no builder accepts a field of that name.

Hot path: see docs/performance.md.
"""

from __future__ import annotations

import datetime as _dt
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from egressd.audit.fields import RecordError, approval_summary, plain, scrub_mapping, seconds, strip_host
from egressd.vocabulary.egress import Decision, EgressKind, End
from egressd.vocabulary.reasons import Reason

__all__ = [
    "APPROVAL_ABANDONED",
    "ApprovalSummary",
    "EgressDecided",
    "EgressEnded",
    "APPROVAL_DECIDED",
    "APPROVAL_REQUESTED",
    "CHAIN_FIELD",
    "DECISIONS",
    "EGRESS",
    "EGRESS_END",
    "EGRESS_END_FIELDS",
    "EGRESS_FIELDS",
    "ENDS",
    "EGRESS_KINDS",
    "EGRESS_SUPPRESSED",
    "FLEET_STATE",
    "POLICY_RELOADED",
    "RUN_CHANGED",
    "RUN_END",
    "RUN_START",
    "new_request_id",
    "rfc3339",
    "fleet_state_record",
    "policy_reloaded_record",
    "run_changed_record",
    "run_record",
    "suppressed_record",
]

EGRESS = "egress"
EGRESS_END = "egress.end"
RUN_START = "run.start"
RUN_END = "run.end"
APPROVAL_REQUESTED = "approval.requested"
APPROVAL_DECIDED = "approval.decided"
# Not in the design's list: every client waiting for an approval gave up
# (it stays answerable; an answer still applies to the run).
APPROVAL_ABANDONED = "approval.abandoned"
EGRESS_SUPPRESSED = "egress.suppressed"
# Not in the design's list: live policy changes (SIGHUP, PATCH /runs/ID).
POLICY_RELOADED = "policy.reloaded"
RUN_CHANGED = "run.changed"
# Not in the design's list: a fleet's database lost and found again (``serve --state``).
FLEET_STATE = "fleet.state"

# The design fixes these keys and their order; every egress record carries
# all of them, null when not applicable, so readers never need .get().
EGRESS_FIELDS: tuple[str, ...] = (
    "event",
    "id",
    "ts",
    "run",
    "kind",
    "client",
    "host",
    "port",
    "address",
    "decision",
    "reason",
    "rule",
    "approval",
    "command",
    "bytes_up",
    "bytes_down",
    "duration_s",
)

# An allowed connection's second record, written when it ends (its first,
# the ``egress`` record, was written before egressd dialled).
EGRESS_END_FIELDS: tuple[str, ...] = (
    "event",
    "id",
    "ts",
    "run",
    "address",
    "bytes_up",
    "bytes_down",
    "duration_s",
    "end",
)
# Why an allowed connection ended when nothing was refused; any other ``end``
# is a reason code (``sni_mismatch``, ``upstream_unreachable``, ...): the
# connection was cut, and readers show it as a refusal.
ENDS: frozenset[str] = frozenset(End)

_EGRESS_FIELD_SET: frozenset[str] = frozenset(EGRESS_FIELDS)
_END_RESERVED: frozenset[str] = frozenset(EGRESS_END_FIELDS) | {"prev"}
# The writer's own field (the hash chain); a builder's caller cannot set it.
CHAIN_FIELD = "prev"
_EGRESS_RESERVED: frozenset[str] = _EGRESS_FIELD_SET | {CHAIN_FIELD}

EGRESS_KINDS: frozenset[str] = frozenset(EgressKind)  # the strings a record's ``kind`` may hold
DECISIONS: frozenset[str] = frozenset(Decision)

def new_request_id() -> str:
    """Return a fresh request id such as ``q-3f9c0a1b2d4e5f60``.

    64 random bits: short enough to read out from a refusal body, unguessable
    so one client cannot name another's request. URL-safe.
    """
    # Drawn from a pool of the OS's randomness, refilled 4 KiB at a time: one
    # getrandom call per 512 ids instead of one per id (one id per connection).
    global _id_pool, _id_at
    if _id_at >= len(_id_pool):
        _id_pool, _id_at = secrets.token_bytes(4096), 0
    start, _id_at = _id_at, _id_at + 8
    return "q-" + _id_pool[start:_id_at].hex()


_id_pool = b""
_id_at = 0


def rfc3339(ts: float) -> str:
    """Format epoch seconds as RFC 3339 UTC with microseconds.

    ``rfc3339(0.5) == "1970-01-01T00:00:00.500000Z"``. Raises ``RecordError``
    for a value that is not a finite time.
    """
    # One record per connection calls this: the formatted second is kept and
    # only the microseconds are formatted anew while the second stays the same.
    global _last_second, _last_text
    try:
        # math.floor is ``ts // 1`` for a float (exact, and as ts // 1 refuses NaN and infinities), in one call.
        second = _floor(ts) if ts.__class__ is float else int(ts // 1)
        micros = round((ts - second) * 1_000_000)
        if micros == 1_000_000:
            second, micros = second + 1, 0
        if second != _last_second:
            moment = _dt.datetime.fromtimestamp(second, tz=_dt.UTC)
            _last_second, _last_text = second, moment.strftime("%Y-%m-%dT%H:%M:%S.")
    except (OverflowError, OSError, ValueError, TypeError) as exc:
        raise RecordError(f"not a timestamp: {ts!r}") from exc
    return _last_text + str(micros).zfill(6) + "Z"  # f"{micros:06d}", without parsing a format spec


_floor = math.floor
# The epoch second rfc3339 formatted last, and its text (with the dot before the microseconds).
_last_second: int | None = None
_last_text = ""


# The plain strings a record holds (a dict lookup: cheaper than ``.value`` per record).
_KIND_TEXT: dict[object, str] = {kind: kind.value for kind in EgressKind}
_DECISION_TEXT: dict[object, str] = {decision: decision.value for decision in Decision}
_END_TEXT: dict[object, str] = {end: end.value for end in End}


@dataclass(frozen=True, slots=True)
class ApprovalSummary:
    """The ``approval`` field of an egress record: the approval asked for it."""

    id: str | None  # the design's field name, shadowing the builtin
    channel: str | None
    by: str | None
    waited_s: float

    def record(self) -> dict[str, object]:
        return approval_summary({"id": self.id, "channel": self.channel, "by": self.by, "waited_s": self.waited_s})


class EgressDecided(NamedTuple):
    """One attempt, decided: the content of its ``egress`` record.

    An allowed connection's record is written ahead (before the dial), with
    ``bytes_up``, ``bytes_down`` and ``duration_s`` None; a refusal's is
    final and carries them. ``extra`` holds what the kind adds
    (``qtype``/``answer`` for DNS, ``status`` for http, ``detail``, ...).

    A named tuple, not a frozen dataclass: one is built per connection and
    per DNS query, and a tuple is built in a fifth of the time (a frozen
    dataclass sets each of its 17 fields through ``object.__setattr__``).
    What the types cannot say is checked by ``record()``.
    """

    id: str  # the design's field name, shadowing the builtin
    ts: float
    run: str | None
    kind: EgressKind
    client: str | None
    host: str | None
    port: int | None
    address: str | None
    decision: Decision
    reason: str | None
    rule: str | None
    approval: ApprovalSummary | Mapping[str, object] | None
    command: str | None
    bytes_up: int | None = None
    bytes_down: int | None = None
    duration_s: float | None = None
    extra: Mapping[str, object] | None = None

    def record(self) -> dict[str, object]:
        """The ``egress`` record: every key of ``EGRESS_FIELDS`` in that order, then the ``extra`` keys.

        ``host`` loses any userinfo, path or query string the caller forgot
        to remove; ``duration_s`` is rounded to microseconds; credential-named
        keys are dropped from ``approval`` and ``extra``. ``RecordError`` for
        a ``kind`` or ``decision`` that is not one of its enum's values, a
        duration that is not a finite number, or an ``extra`` key that would
        shadow a field or set ``prev``.
        """
        # One unpacking, not seventeen attribute lookups (a named tuple's fields are descriptors).
        (
            id_,
            ts,
            run,
            kind,
            client,
            host,
            port,
            address,
            decision,
            reason,
            rule,
            approval,
            command,
            bytes_up,
            bytes_down,
            duration_s,
            extra,
        ) = self
        try:
            kind_text, decision_text = _KIND_TEXT[kind], _DECISION_TEXT[decision]
        except (KeyError, TypeError):
            raise RecordError(
                f"kind and decision must be EgressKind and Decision, not {kind!r}, {decision!r}"
            ) from None
        if extra and not _EGRESS_RESERVED.isdisjoint(extra):
            clash = sorted(set(extra) & _EGRESS_RESERVED)
            raise RecordError(f"extra fields shadow egress fields: {', '.join(clash)}")
        record: dict[str, object] = {
            "event": EGRESS,
            "id": id_,
            "ts": rfc3339(ts),
            "run": run,
            "kind": kind_text,
            "client": client,
            # strip_host's own first test, inline: most hosts have nothing to strip.
            "host": host
            if host is None or not ("@" in host or "/" in host or "?" in host or "#" in host)
            else strip_host(host),
            "port": port,
            "address": address,
            "decision": decision_text,
            "reason": reason if reason.__class__ is str else plain(reason),
            "rule": rule,
            "approval": (
                None
                if approval is None
                else approval.record()
                if isinstance(approval, ApprovalSummary)
                else approval_summary(approval)
            ),
            "command": command,
            "bytes_up": bytes_up,
            "bytes_down": bytes_down,
            # seconds, inline for None and a finite float (inf - inf and NaN are NaN).
            "duration_s": duration_s
            if duration_s is None
            else round(duration_s, 6)
            if duration_s.__class__ is float and duration_s - duration_s == 0.0
            else seconds(duration_s, "duration_s"),
        }
        if extra:
            record.update(scrub_mapping(extra))
        return record


class EgressEnded(NamedTuple):
    """How an allowed connection ended: the content of its ``egress.end`` record.

    ``id`` is the id of the ``egress`` record it ends; ``address`` the one
    finally dialled (None when no dial succeeded); ``end`` one of ``ENDS``
    or a reason code; ``extra`` what was learnt on the way (``status`` for
    http, ``detail``, ``sni``). A named tuple for the reason ``EgressDecided``
    is one; ``record()`` checks what the types cannot.
    """

    id: str  # the design's field name
    ts: float
    run: str | None
    address: str | None
    bytes_up: int | None  # None: not known (``worker_lost``)
    bytes_down: int | None
    duration_s: float
    end: End | Reason | str  # a code read back from a record is a string
    extra: Mapping[str, object] | None = None

    def record(self) -> dict[str, object]:
        """The ``egress.end`` record: ``EGRESS_END_FIELDS`` in order, then the scrubbed ``extra`` keys.

        ``RecordError`` for an empty ``end`` or an ``extra`` key that would shadow a field.
        """
        id_, ts, run, address, bytes_up, bytes_down, duration_s, end, extra = self
        if end.__class__ is not str:
            end = _END_TEXT.get(end) or str(end)  # an End, or the Reason that cut the connection
        if not end or end.__class__ is not str:
            raise RecordError(f"end must be a non-empty string, not {end!r}")
        if extra and not _END_RESERVED.isdisjoint(extra):
            clash = sorted(set(extra) & _END_RESERVED)
            raise RecordError(f"extra fields shadow egress.end fields: {', '.join(clash)}")
        record: dict[str, object] = {
            "event": EGRESS_END,
            "id": id_,
            "ts": rfc3339(ts),
            "run": run,
            "address": address,
            "bytes_up": bytes_up,
            "bytes_down": bytes_down,
            # seconds, inline for a finite float (inf - inf and NaN are NaN).
            "duration_s": round(duration_s, 6)
            if duration_s.__class__ is float and duration_s - duration_s == 0.0
            else seconds(duration_s, "duration_s"),
            "end": end,
        }
        if extra:
            record.update(scrub_mapping(extra))
        return record


def run_record(event: str, *, ts: float, run: str, **fields: object) -> dict[str, object]:
    """Build a ``run.start`` or ``run.end`` record.

    ``fields`` (task, allow, sources, exit status, ...) are copied with every
    key whose name mentions a credential (token, password, secret,
    credentials, authorization, ...; case-insensitive, at any depth) dropped
    and the userinfo removed from any URL inside a string. Raises
    ``RecordError`` for another event name or a field named event/ts/run/prev.
    """
    if event not in (RUN_START, RUN_END):
        raise RecordError(f"not a run event: {event!r}")
    clash = sorted(set(fields) & {"event", "ts", "run", CHAIN_FIELD})
    if clash:
        raise RecordError(f"fields shadow run record keys: {', '.join(clash)}")
    record: dict[str, object] = {"event": event, "ts": rfc3339(ts), "run": run}
    record.update(scrub_mapping(fields))
    return record


def _entry_lists(value: Mapping[str, Sequence[str]] | None) -> dict[str, list[str]]:
    """``{"allow": [...], "deny": [...]}``, both keys always present; RecordError for another key."""
    value = value or {}
    strange = sorted(set(value) - {"allow", "deny"})
    if strange:
        raise RecordError(f"entry lists are allow and deny, not {', '.join(strange)}")
    return {key: [str(text) for text in value.get(key, ())] for key in ("allow", "deny")}


def policy_reloaded_record(
    *,
    ts: float,
    ok: bool,
    added: Mapping[str, Sequence[str]] | None = None,
    removed: Mapping[str, Sequence[str]] | None = None,
    changed: Sequence[str] | None = None,
    needs_restart: Sequence[str] | None = None,
    live_kept: Mapping[str, Mapping[str, Sequence[str]]] | None = None,
    live_in_files: Mapping[str, Mapping[str, Sequence[str]]] | None = None,
    error: str | None = None,
) -> dict[str, object]:
    """Build the ``policy.reloaded`` record: ``egressd serve`` re-read its config and allow file (SIGHUP).

    Fields, in this order: ``event``, ``ts``, ``ok``; ``added`` and
    ``removed``, each ``{"allow": [...], "deny": [...]}``, the configured
    entries (command line, environment, config file, presets, allow file)
    that the reload added or removed; ``changed``, the other live settings
    whose value changed (``allow_private``, ``ask``); ``needs_restart``, the
    settings that changed but apply only at start-up (kept as they were);
    ``live_kept``, the default run's live edits (``egressd policy``, ``PATCH
    /runs/default``) laid on top of the configured entries again, and
    ``live_in_files``, those the configured entries now say themselves (the
    files rule them from now on), each ``{"allow": {"added": [...],
    "removed": [...]}, "deny": {...}}``; ``error``, why the reload was
    refused. ``ok`` true: ``error`` is null. ``ok`` false (nothing was
    applied): ``error`` says why, and every other field is null.
    """
    if ok == (error is not None):
        raise RecordError("a policy.reloaded record has an error exactly when it is not ok")
    return {
        "event": POLICY_RELOADED,
        "ts": rfc3339(ts),
        "ok": ok,
        "added": _entry_lists(added) if ok else None,
        "removed": _entry_lists(removed) if ok else None,
        "changed": [str(name) for name in changed or ()] if ok else None,
        "needs_restart": [str(name) for name in needs_restart or ()] if ok else None,
        "live_kept": _edit_lists(live_kept) if ok else None,
        "live_in_files": _edit_lists(live_in_files) if ok else None,
        "error": error,
    }


def _edit_lists(value: Mapping[str, Mapping[str, Sequence[str]]] | None) -> dict[str, dict[str, list[str]]]:
    """``{"allow": {"added": [...], "removed": [...]}, "deny": {...}}``, every key present; RecordError otherwise."""
    value = value or {}
    strange = sorted(set(value) - {"allow", "deny"})
    if strange:
        raise RecordError(f"entry edits are allow and deny, not {', '.join(strange)}")
    lists: dict[str, dict[str, list[str]]] = {}
    for kind in ("allow", "deny"):
        part = value.get(kind) or {}
        strange = sorted(set(part) - {"added", "removed"})
        if strange:
            raise RecordError(f"{kind} edits are added and removed, not {', '.join(strange)}")
        lists[kind] = {key: [str(text) for text in part.get(key, ())] for key in ("added", "removed")}
    return lists


def fleet_state_record(*, ts: float, instance: str, reachable: bool, error: str | None = None) -> dict[str, object]:
    """Build the ``fleet.state`` record: this instance lost its fleet's database (``reachable`` false, ``error``
    why: nothing secret, the URI is never in it) or found it again (``error`` null)."""
    if reachable == (error is not None):
        raise RecordError("a fleet.state record has an error exactly when the database is unreachable")
    return {"event": FLEET_STATE, "ts": rfc3339(ts), "instance": instance, "reachable": reachable, "error": error}


def run_changed_record(
    *,
    ts: float,
    run: str | None,
    added: Mapping[str, Sequence[str]] | None = None,
    removed: Mapping[str, Sequence[str]] | None = None,
    revoked: Sequence[str] = (),
    always_revoked: Sequence[str] = (),
    auth: str | None = None,
) -> dict[str, object]:
    """Build the ``run.changed`` record: a live run's entries edited through ``PATCH /runs/ID`` or the page.

    Fields, in this order: ``event``, ``ts``, ``run``, ``added`` and
    ``removed``, each ``{"allow": [...], "deny": [...]}`` (the entries as
    given; an entry the run already had is not in ``added``), then
    ``revoked`` (approvals taken back: ``host`` or ``host:port``) when any was,
    ``always_revoked`` (the allow file's *always* entries taken back, for
    every run; ``run`` null when the page revoked one alone) when any was, and
    ``auth`` (the credential, when a page session acted: the control API's
    token is its own).
    """
    record: dict[str, object] = {
        "event": RUN_CHANGED,
        "ts": rfc3339(ts),
        "run": run,
        "added": _entry_lists(added),
        "removed": _entry_lists(removed),
    }
    if revoked:
        record["revoked"] = list(revoked)
    if always_revoked:
        record["always_revoked"] = list(always_revoked)
    if auth is not None:
        record["auth"] = auth
    return record


def suppressed_record(
    *,
    ts: float,
    run: str | None,
    start: float,
    end: float,
    counts: Mapping[tuple[str, str], int],
    samples: Sequence[str],
) -> dict[str, object]:
    """Build the ``egress.suppressed`` record: refusals of one run counted instead of recorded.

    ``start``/``end`` bound the interval (epoch seconds); ``counts`` maps
    (kind, reason) to how many refusals of that kind and reason were not
    written one by one; ``suppressed`` is their sum; ``samples`` names a few
    of the hosts asked for. ``decision`` is ``deny`` (every one was refused),
    so ``egressd audit --decision deny`` shows it beside the refusals.
    """
    by_kind: dict[str, dict[str, int]] = {}
    for (kind, reason), count in sorted(counts.items()):
        by_kind.setdefault(str(kind), {})[str(reason)] = int(count)
    return {
        "event": EGRESS_SUPPRESSED,
        "ts": rfc3339(ts),
        "run": run,
        "decision": "deny",
        "start": rfc3339(start),
        "end": rfc3339(end),
        "suppressed": sum(by_kind[k][r] for k in by_kind for r in by_kind[k]),
        "counts": by_kind,
        "samples": [strip_host(sample) for sample in samples],
    }


